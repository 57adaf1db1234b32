"""One shared inference server for the whole test module (vLLM on CPU starts in ~25 s).

The server runs as a real ``inference @ infer.toml`` subprocess on a tiny fp32 Qwen3 with tied
embeddings (the case where the LM head's packed copy must be rebuilt after a reload).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from prime_rl.common.testing import make_tiny_model
from prime_rl.inference.testing import Server, start_server, stop_server

# prime-rl-inference without its cpu/gpu extra (scripts/check_packages.sh): only the engine-free tests.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["test_server.py", "test_router.py"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", dtype="float32", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def server(tmp_path_factory, tiny_model) -> Server:
    tmp = tmp_path_factory.mktemp("server")
    server = start_server(tmp, tiny_model)
    yield server
    stop_server(server.proc)
