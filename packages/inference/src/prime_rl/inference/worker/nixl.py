"""NIXL transport inside a vLLM worker: the receiver, the engine load and the rollback.

The extension methods ``prime_init_nixl`` / ``prime_receive_nixl`` delegate here. Groups reach the
model through vLLM's layerwise reload like the other transports, but the reload is started only when
the first group has arrived: an update that fails before that leaves the model untouched. One that
fails later is rolled back by reloading the receiver's host copy of the last complete NIXL update.
"""

from __future__ import annotations

from typing import Any

import torch

from prime_rl.common.nixl_metadata import MetadataClient
from prime_rl.common.weight_sync.nixl_receiver import NixlReceiver, NixlTransferError


class LayerwiseReload:
    """vLLM's layerwise reload opened lazily on the first batch (push-style twin of ``_prime_reload``)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
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
            # Copies: the reload keeps the tensors of a layer until all of its weights have arrived, and
            # a layer may span two groups, while the arena is overwritten by the next group.
            model.load_weights([(name, t.clone()) for name, t in batch])
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


def init_receiver(
    worker: Any, host: str, port: int, session: str, rank_offset: int, keep_rollback_copy: bool, timeout_s: float
) -> NixlReceiver:
    client = MetadataClient(host, port)
    try:
        device = worker.model_runner.device
        rank = rank_offset + worker._prime_global_rank()
        return NixlReceiver(
            client,
            session,
            rank,
            device=torch.device(device),
            keep_rollback_copy=keep_rollback_copy,
            timeout_s=timeout_s,
        )
    finally:
        client.close()


def receive(worker: Any, receiver: NixlReceiver, version: int) -> dict:
    """Pull ``version`` into the model; on failure leave the previous weights in place or say why not."""
    served = receiver.version
    reload = LayerwiseReload(worker)
    try:
        stats = receiver.receive(version, reload.load)
    except Exception as e:
        reload.finish()
        if reload.count == 0:
            raise NixlTransferError(f"{e}; no tensor reached the model, version {served} is still served") from e
        batches = receiver.rollback_batches()
        if batches is None:
            raise NixlTransferError(
                f"{e}; {reload.count} tensors were already loaded and there is no rollback copy "
                "(keep_rollback_copy = false, or no complete NIXL update yet): the model is partially updated, "
                "send a full update again"
            ) from e
        worker._prime_reload(batches)
        raise NixlTransferError(f"{e}; rolled back to version {served}, which is still served") from e
    reload.finish()
    return {**stats, "tensors": reload.count}
