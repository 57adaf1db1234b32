"""vLLM's layerwise reload driven batch by batch, shared by the transports that stream into the model."""

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
