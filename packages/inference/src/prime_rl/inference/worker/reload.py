"""Loading checkpoint-format tensors into a served vLLM model, batch by batch, shared by every transport.

Two ways, chosen once per model (``direct_load_reason``):
- **direct**: ``model.load_weights`` copies each tensor straight into the served parameter (fusing qkv /
  gate_up through the parameters' own loaders). Exact only where loading needs no post-processing: an
  unquantized dense model on CUDA, whose linear and embedding methods process nothing after loading.
- **layerwise** (everything else: CPU, where linear layers are repacked; quantized, MoE, LoRA models):
  vLLM's layerwise reload rebuilds each layer, reruns its post-load processing and copies the result
  into the served storage. It keeps every tensor of a layer until the layer is complete, and its Python
  bookkeeping runs per weight-loader call.

Also the one fix-up the reload needs for MoE on CPU (``apply_moe_repack_on_reload``): vLLM 0.32 builds an
unquantized MoE layer's kernel on the first load and, in ``UnquantizedFusedMoEMethod._setup_kernel``, runs
the experts' own ``process_weights_after_loading`` only then. On CPU that is where w13/w2 are zero-padded
and prepacked into the grouped-gemm layout, so a reload copied checkpoint-layout experts into storage the
kernel reads as packed: the same weights computed different logits (mismatch_kl 1e-5 -> 1e-3 after the
first update of a tiny Qwen3-MoE with lr 0, benchmarks/results/moe_mismatch.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)


_DIRECT_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
"""vLLM quant methods whose ``process_weights_after_loading`` does nothing on CUDA (exact class names:
a subclass may process)."""


def direct_load_reason(model: torch.nn.Module, vllm_config: Any, device_type: str) -> str | None:
    """None when ``model.load_weights`` alone leaves ``model`` exactly as a full reload would; else why not.

    A full reload is ``load_weights`` followed by vLLM's ``process_weights_after_loading`` over every module
    (its quant methods, attention layers, HPC modules). On CUDA the unquantized linear and embedding
    methods process nothing, attention layers receive no checkpoint weights, and a model without other
    quant methods or HPC modules has nothing else to process."""
    if device_type != "cuda":
        return f"the model is on {device_type}, where vLLM repacks linear weights after loading"
    if getattr(vllm_config.model_config, "quantization", None) is not None:
        return f"quantization {vllm_config.model_config.quantization!r} processes weights after loading"
    if getattr(vllm_config, "lora_config", None) is not None:
        return "LoRA wraps the layers that load the weights"
    for name, module in model.named_modules():
        if any(cls.__name__ == "HpcModule" for cls in type(module).__mro__):
            return f"{name} ({type(module).__name__}) processes its weights after loading"
        method = getattr(module, "quant_method", None)
        if method is not None and type(method).__name__ not in _DIRECT_METHODS:
            return f"{name} uses {type(method).__name__}, which may process its weights after loading"
    return None


class ModelReload:
    """One update's load into the served model, opened lazily on the first batch: direct when
    ``direct_load_reason`` allows it (decided once per worker), else vLLM's layerwise reload.

    ``copy``: the layerwise reload loads copies of the batch's tensors. Needed when the batch is a view of a
    buffer the transport overwrites with the next batch (NIXL's arenas, IPC slots): the reload keeps a layer's
    tensors until all of its weights have arrived, and a layer may span two batches. A broadcast bucket is a
    fresh buffer: no copy. The direct load copies into the parameters at once and never needs one.
    """

    def __init__(self, worker: Any, copy: bool = True) -> None:
        self.worker = worker
        self.copy = copy
        self.count = 0
        self._context = None
        self.direct = False

    def load(self, batch: Iterable[tuple[str, torch.Tensor]]) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        model = self.worker._prime_model()
        if self._context is None:
            self.direct = _direct_load(self.worker, model)
            self._context = set_current_vllm_config(self.worker.vllm_config)
            self._context.__enter__()
            if not self.direct:
                apply_moe_repack_on_reload(model)
                with torch.inference_mode():
                    initialize_layerwise_reload(model)
        if self.copy and not self.direct:
            batch = [(name, t.clone()) for name, t in batch]
        with torch.inference_mode():
            model.load_weights(self._counted(batch))

    def _counted(self, batch: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for item in batch:  # streamed: a checkpoint's file iterator is never held whole
            self.count += 1
            yield item

    def finish(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._context is None:
            return
        try:
            model = self.worker._prime_model()
            if not self.direct:
                with torch.inference_mode():
                    finalize_layerwise_reload(model, self.worker.vllm_config.model_config)
                    self.worker._prime_refresh_tied_lm_head(model)
        finally:
            self._context.__exit__(None, None, None)
            self._context = None
            if not self.direct and torch.cuda.is_initialized():
                # The reload's copies (``copy``) stay cached by this process's allocator, outside vLLM's share: on
                # the H200 a colocated KV cache then woke out of memory. Return them to the driver.
                torch.cuda.empty_cache()


def _direct_load(worker: Any, model: torch.nn.Module) -> bool:
    """Whether ``worker`` loads ``model`` directly; decided on the first load and logged with the reason."""
    decided = getattr(worker, "_prime_direct_load", None)
    if decided is None:
        device = next(model.parameters()).device.type
        reason = direct_load_reason(model, worker.vllm_config, device)
        decided = reason is None
        worker._prime_direct_load = decided
        how = "direct (model.load_weights into the served parameters)" if decided else f"layerwise: {reason}"
        logger.info("weight updates load %s", how)
    return decided


def apply_moe_repack_on_reload(model: torch.nn.Module) -> None:
    """Make each CPU unquantized MoE layer repack its experts whenever a layerwise reload processes it.

    The reload materializes the layer, loads checkpoint-layout weights into it, calls
    ``quant_method.process_weights_after_loading`` and copies the result into the served storage; we add the
    experts' repack (which vLLM skips once the kernel exists) to that call, so what is copied is packed
    exactly as at startup. Idempotent; layers of other backends (GPU, zentorch) are left alone.
    """
    try:  # vLLM 0.32's module layout; the GPU machine's 0.26 has no such CPU experts: nothing to repack there
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:
        return

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or "_prime_repacks" in vars(method):
            continue
        kernel = getattr(method, "moe_kernel", None)
        if kernel is None or not isinstance(kernel.fused_experts, CPUUnquantizedExperts):
            continue
        method.process_weights_after_loading = _with_experts_repack(method)
        method._prime_repacks = True


def _with_experts_repack(method: Any) -> Any:
    process = method.process_weights_after_loading  # bound, before we replace it on the instance

    def process_and_repack(layer: torch.nn.Module) -> None:
        process(layer)
        method.moe_kernel.fused_experts.process_weights_after_loading(layer)

    return process_and_repack
