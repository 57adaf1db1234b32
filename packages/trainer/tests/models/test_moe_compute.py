"""Routed-expert precision (`[model.moe.compute]`, models/moe_compute.py): bf16 runs, the other types refuse at
start-up in one line, before any weight is read. (`type = "fp8"` is refused by the config itself:
packages/common/tests/test_config.py.)"""

from __future__ import annotations

import sys
import types

import pytest

from prime_rl.common.config.trainer import (
    BF16ComputeConfig,
    DeepGEMMFP8ComputeConfig,
    MoEConfig,
    MXFP8ComputeConfig,
    TrainerModelConfig,
)
from prime_rl.trainer.models import load_arch_config
from prime_rl.trainer.models.moe_compute import check_moe_compute
from prime_rl.trainer.parallel.layout import resolve_parallel_dims


def test_start_up_accepts_bf16():
    check_moe_compute(BF16ComputeConfig(), "cpu")
    check_moe_compute(BF16ComputeConfig(), None)


def test_deepgemm_fp8_refuses_in_one_line_naming_deep_gemm(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import deep_gemm -> ImportError, installed or not
    with pytest.raises(ImportError, match="needs the `deep_gemm` package") as e:
        check_moe_compute(DeepGEMMFP8ComputeConfig(), "cpu")
    assert "\n" not in str(e.value) and str(e.value).endswith('use type = "bf16"')
    # importable: still refused (not wired in), no kernel call attempted
    monkeypatch.setitem(sys.modules, "deep_gemm", types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=None))
    with pytest.raises(ImportError, match="not wired into this trainer yet"):
        check_moe_compute(DeepGEMMFP8ComputeConfig(), "cpu")


def test_mxfp8_refuses_in_one_line_naming_sm100():
    with pytest.raises(RuntimeError, match=r"needs an SM100 \(Blackwell\) GPU, found no CUDA GPU") as e:
        check_moe_compute(MXFP8ComputeConfig(), "cpu")
    assert "\n" not in str(e.value) and str(e.value).endswith('use type = "bf16"')


@pytest.mark.parametrize("compute", [MXFP8ComputeConfig(), DeepGEMMFP8ComputeConfig()], ids=lambda c: c.type)
def test_refusal_happens_in_layout_resolution_before_any_weight_is_read(hf_model_factory, monkeypatch, compute):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    _, path = hf_model_factory("qwen3_moe")
    for f in path.glob("*.safetensors"):
        f.unlink()  # nothing to read: the refusal must come first
    cfg = TrainerModelConfig(name=str(path), moe=MoEConfig(compute=compute))
    with pytest.raises((ImportError, RuntimeError), match=f'type = "{compute.type}"'):
        resolve_parallel_dims(cfg, 1, load_arch_config(str(path)))
