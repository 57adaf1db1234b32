"""vLLM's layerwise reload driven batch by batch, shared by the transports that stream into the model.

Also the one fix-up the reload needs for MoE on CPU (``apply_moe_repack_on_reload``): vLLM 0.32 builds an
unquantized MoE layer's kernel on the first load and, in ``UnquantizedFusedMoEMethod._setup_kernel``, runs
the experts' own ``process_weights_after_loading`` only then. On CPU that is where w13/w2 are zero-padded
and prepacked into the grouped-gemm layout, so a reload copied checkpoint-layout experts into storage the
kernel reads as packed: the same weights computed different logits (mismatch_kl 1e-5 -> 1e-3 after the
first update of a tiny Qwen3-MoE with lr 0, benchmarks/results/moe_mismatch.md).
"""

from __future__ import annotations

from typing import Any

import torch


class LayerwiseReload:
    """vLLM's layerwise reload opened lazily on the first batch (push-style twin of ``_prime_reload``).

    ``copy``: load copies of the batch's tensors. Needed when the batch is a view of a buffer the transport
    overwrites with the next batch (NIXL's arenas): the reload keeps a layer's tensors until all of its
    weights have arrived, and a layer may span two batches. A broadcast bucket is a fresh buffer: no copy.
    """

    def __init__(self, worker: Any, copy: bool = True) -> None:
        self.worker = worker
        self.copy = copy
        self.count = 0
        self._context = None

    def load(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        model = self.worker._prime_model()
        if self._context is None:
            self._context = set_current_vllm_config(self.worker.vllm_config)
            self._context.__enter__()
            apply_moe_repack_on_reload(model)
            with torch.inference_mode():
                initialize_layerwise_reload(model)
        with torch.inference_mode():
            model.load_weights([(name, t.clone()) for name, t in batch] if self.copy else batch)
        self.count += len(batch)

    def finish(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._context is None:
            return
        try:
            model = self.worker._prime_model()
            with torch.inference_mode():
                finalize_layerwise_reload(model, self.worker.vllm_config.model_config)
                self.worker._prime_refresh_tied_lm_head(model)
        finally:
            self._context.__exit__(None, None, None)
            self._context = None
            if torch.cuda.is_initialized():
                # The reload's copies (``copy``) stay cached by this process's allocator, outside vLLM's share: on
                # the H200 a colocated KV cache then woke out of memory. Return them to the driver.
                torch.cuda.empty_cache()


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
