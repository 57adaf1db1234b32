"""End to end against one real vLLM (CPU) server: generation, weight updates by file and by broadcast,
pausing with requests in flight, and refused updates.

Tests share the session server and run in file order; each update test leaves the server on the
version it checks, and the next one starts from there.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from prime_rl.common.net import reserve_ports
from prime_rl.common.weight_checksum import write_checksums
from prime_rl.common.wire import (
    AwaitWeightsRequest,
    ControlReply,
    HealthReply,
    HealthRequest,
    LoadWeightsRequest,
    PauseRequest,
    ResumeRequest,
)
from prime_rl.inference.testing import server_logprobs as served_logprobs

pytestmark = pytest.mark.xdist_group("vllm_server")

PROMPT = [5, 17, 42, 99, 120, 7, 300, 64, 11, 250]
TOL = 1e-4  # fp32 model: vLLM and transformers agree to ~1e-6


def server_logprobs(server, ids: list[int] = PROMPT) -> list[float]:
    return served_logprobs(server, ids)


def hf_logprobs(model_dir: Path, state_dict: dict[str, torch.Tensor], ids: list[int] = PROMPT) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    lp = torch.log_softmax(logits.double(), -1)
    return [lp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def perturbed(model_dir: Path, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    base = load_file(model_dir / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    return {k: (v + scale * torch.randn(v.shape, generator=g)).contiguous() for k, v in base.items()}


def write_step(root: Path, step: int, state_dict: dict[str, torch.Tensor], marker: bool = True) -> Path:
    out = root / "broadcasts" / f"step_{step}"
    out.mkdir(parents=True, exist_ok=True)
    save_file(state_dict, out / "model.safetensors", metadata={"format": "pt"})
    if marker:
        (out / "STABLE").touch()
    return out


def health(server) -> HealthReply:
    with server.client() as c:
        reply = c.request(HealthRequest())
    assert isinstance(reply, HealthReply)
    return reply


def request(server, message) -> ControlReply:
    with server.client() as c:
        reply = c.request(message)
    assert isinstance(reply, ControlReply)
    return reply


# -------------------------------------------------------------------------------------------------


def test_generation_returns_token_ids_logprobs_and_version(server):
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={
            "model": str(server.model_dir),
            "prompt": "The quick brown fox",
            "max_tokens": 8,
            "logprobs": 1,
            "return_token_ids": True,
            "ignore_eos": True,
        },
        timeout=60,
    )
    r.raise_for_status()
    choice = r.json()["choices"][0]
    assert len(choice["token_ids"]) == 8
    assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
    # Token-in / token-out endpoint: each token range is tagged with the weight version that sampled it.
    g = httpx.post(
        f"{server.url}/inference/v1/generate",
        json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 6, "logprobs": 0, "ignore_eos": True}},
        timeout=60,
    )
    g.raise_for_status()
    choice = g.json()["choices"][0]
    assert len(choice["token_ids"]) == 6
    assert choice["weight_versions"] == [{"version": str(health(server).weight_version), "start": 0, "end": 6}]


def test_base_weights_match_transformers(server):
    base = load_file(server.model_dir / "model.safetensors")
    assert max_diff(server_logprobs(server), hf_logprobs(server.model_dir, base)) < TOL


def test_filesystem_update_matches_transformers(server, tmp_path):
    new = perturbed(server.model_dir, seed=1)
    path = write_step(tmp_path, 1, new)
    before = server_logprobs(server)
    reply = request(server, LoadWeightsRequest(path=str(path), version=1))
    assert reply.ok, reply.error
    assert reply.weight_version == 1 and health(server).weight_version == 1
    after = server_logprobs(server)
    assert max_diff(after, before) > 1e-2  # the update changed the model ...
    assert max_diff(after, hf_logprobs(server.model_dir, new)) < TOL  # ... into exactly the new weights
    g = httpx.post(
        f"{server.url}/inference/v1/generate",
        json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 3, "ignore_eos": True}},
        timeout=60,
    ).json()
    assert g["choices"][0]["weight_versions"][0]["version"] == "1"


@pytest.mark.parametrize(
    "defect",
    [
        "no_marker",
        "missing_tensor",
        "wrong_shape",
        "wrong_dtype",
        "unknown_tensor",
        "no_directory",
        "truncated_data",
        "nan_value",
        "bad_checksum",
    ],
)
@pytest.mark.chaos
def test_bad_filesystem_update_is_refused(server, tmp_path, defect):
    version_before = health(server).weight_version
    logprobs_before = server_logprobs(server)
    sd = perturbed(server.model_dir, seed=7)
    name = "model.layers.0.self_attn.q_proj.weight"
    if defect == "missing_tensor":
        del sd[name]
    elif defect == "wrong_shape":
        sd[name] = sd[name][:-1].contiguous()
    elif defect == "wrong_dtype":
        sd[name] = sd[name].to(torch.bfloat16)
    elif defect == "unknown_tensor":
        sd["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
    elif defect == "nan_value":
        sd[name][3, 5] = float("nan")
    path = write_step(tmp_path, 99, sd, marker=defect != "no_marker")
    if defect == "no_directory":
        path = tmp_path / "does_not_exist"
    elif defect == "truncated_data":  # header intact, data cut: passed the old header-only check
        file = path / "model.safetensors"
        file.write_bytes(file.read_bytes()[:-1000])
    elif defect == "bad_checksum":  # a finite, well-sized tensor changed after the trainer wrote it
        write_checksums(path)
        sd["model.norm.weight"][0] += 1.0
        save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    reply = request(server, LoadWeightsRequest(path=str(path), version=99))
    assert not reply.ok
    expected = {
        "no_marker": "STABLE",
        "missing_tensor": "missing",
        "wrong_shape": "wrong shape",
        "wrong_dtype": "wrong dtype",
        "unknown_tensor": "does not have",
        "no_directory": "does not exist",
        "truncated_data": "truncated",
        "nan_value": "NaN/Inf",
        "bad_checksum": "crc32",
    }[defect]
    assert expected in reply.error and (defect == "no_directory" or str(path) in reply.error)
    assert reply.weight_version == version_before == health(server).weight_version
    assert max_diff(server_logprobs(server), logprobs_before) < 1e-6  # still serving the old weights


@pytest.mark.chaos
def test_failed_worker_load_restores_the_previous_weights(server, tmp_path):
    """Probe: a checkpoint that passes every check in the API process but fails in the workers (here a
    header the safetensors reader rejects) must not leave the model half-loaded (meta device)."""
    version_before = health(server).weight_version
    logprobs_before = server_logprobs(server)
    path = write_step(tmp_path, 98, perturbed(server.model_dir, seed=8))
    file = path / "model.safetensors"
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n].replace(b'"format":"pt"', b'"format":1   ')  # same length: data offsets stay valid
    assert header != raw[8 : 8 + n]
    file.write_bytes(raw[:8] + header + raw[8 + n :])
    reply = request(server, LoadWeightsRequest(path=str(path), version=98))
    assert not reply.ok and "serves again" in reply.error, reply.error
    assert reply.weight_version == version_before
    state = health(server)
    assert state.ok and state.error == "" and state.weight_version == version_before
    assert max_diff(server_logprobs(server), logprobs_before) < 1e-6  # the old weights, and a live engine


def _trainer_process(
    control: str, model_dir: str, version: int, seed: int, port: int, corrupt, out, timeout_s: float = 120.0
) -> None:
    """A trainer-like process: builds the gloo group with the server and pushes a state dict.

    corrupt: True (a wrong shape), "nan" (NaN in the last tensor, so every other one is already loaded),
    "die" (push ``version``, then die after the first bucket of ``version + 1``)."""
    import os

    from prime_rl.common.weight_sync.broadcast import (
        Spec,
        WeightBroadcaster,
        WeightBroadcastError,
        pack_bucket,
    )

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


def test_pause_with_requests_in_flight_loses_none(server, tmp_path):
    num_requests, max_tokens = 8, 48
    started = threading.Event()

    def complete(i: int) -> dict:
        started.set()
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={
                "model": str(server.model_dir),
                "prompt": PROMPT[: 3 + i % 5],
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "return_token_ids": True,
            },
            timeout=180,
        )
        r.raise_for_status()
        return r.json()["choices"][0]

    new = perturbed(server.model_dir, seed=4)
    path = write_step(tmp_path, 4, new)
    with ThreadPoolExecutor(num_requests) as pool:
        futures = [pool.submit(complete, i) for i in range(num_requests)]
        started.wait()
        assert request(server, PauseRequest(mode="keep")).ok
        assert health(server).paused
        reply = request(server, LoadWeightsRequest(path=str(path), version=4))
        assert reply.ok, reply.error
        assert health(server).paused  # a client-paused server stays paused through an update
        assert request(server, ResumeRequest()).ok
        choices = [f.result() for f in futures]
    assert [len(c["token_ids"]) for c in choices] == [max_tokens] * num_requests
    assert all(c["finish_reason"] == "length" for c in choices)
    assert not health(server).paused and health(server).weight_version == 4
    assert max_diff(server_logprobs(server), hf_logprobs(server.model_dir, new)) < TOL


def test_unknown_pause_mode_is_refused(server):
    reply = request(server, PauseRequest(mode="sleep"))
    assert not reply.ok and "sleep" in reply.error
    assert not health(server).paused
    json.dumps(reply.error)  # the error is plain text, safe to log anywhere
