"""Two replicas behind vllm-router: sticky sessions, and a weight update sent to every replica.

Slow (two CPU engines start side by side on 2 cores): ``pytest -m slow``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from prime_rl.common.config import parse_config
from prime_rl.common.config.inference import INFERENCE_PORT_HEADROOM, InferenceConfig
from prime_rl.common.net import free_port
from prime_rl.common.transport import ControlClient
from prime_rl.common.wire import HealthRequest, LoadWeightsRequest
from prime_rl.inference.router import replica_endpoints

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm_router")]


def _successes(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(m) for m in re.findall(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("router")
    port = free_port(headroom=INFERENCE_PORT_HEADROOM)
    config_path = tmp / "infer.toml"
    config_path.write_text(
        f'[model]\nname = "{tiny_model}"\n[server]\nhost = "127.0.0.1"\nport = {port}\ncontrol_host = "127.0.0.1"\n'
        f'control_port = {port + 50}\n[vllm]\nenforce_eager = true\ndtype = "float32"\nmax_model_len = 256\n'
        "[router]\nreplicas = 2\n"
    )
    config = parse_config(InferenceConfig, ["@", str(config_path)])
    log = tmp / "inference.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "prime_rl.inference.entrypoint", "@", str(config_path)],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        env=dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1"),
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 400
    while True:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(1)
    yield url, replica_endpoints(config), tiny_model
    proc.terminate()
    proc.wait(timeout=90)


def _complete(url: str, model, session: str) -> dict:
    r = httpx.post(
        f"{url}/v1/completions",
        headers={"x-session-id": session},
        json={"model": str(model), "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True},
        timeout=60,
    )
    r.raise_for_status()
    return r.json()


def test_same_session_goes_to_same_replica(replicas):
    url, endpoints, model = replicas
    before = [_successes(e.url) for e in endpoints]
    for _ in range(4):
        _complete(url, model, "rollout-a")
    delta = [_successes(e.url) - b for e, b in zip(endpoints, before)]
    assert sorted(delta) == [0, 4], delta
    for i in range(16):  # many sessions spread over both replicas
        _complete(url, model, f"rollout-{i}")
    assert all(_successes(e.url) > b for e, b in zip(endpoints, before))


def test_weight_update_reaches_every_replica(replicas, tmp_path):
    from safetensors.torch import load_file, save_file

    url, endpoints, model = replicas
    step = tmp_path / "broadcasts" / "step_1"
    step.mkdir(parents=True)
    save_file(load_file(model / "model.safetensors"), step / "model.safetensors")
    (step / "STABLE").touch()
    for e in endpoints:
        with ControlClient(e.control, timeout_s=60) as c:
            assert c.request(LoadWeightsRequest(path=str(step), version=1)).ok
    for e in endpoints:
        with ControlClient(e.control, timeout_s=10) as c:
            assert c.request(HealthRequest()).weight_version == 1
    _complete(url, model, "after-update")
