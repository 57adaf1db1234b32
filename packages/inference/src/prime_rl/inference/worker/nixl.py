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
from prime_rl.inference.weights.manifest import STILL_SERVED
from prime_rl.inference.weights.nixl_receiver import NixlReceiver, NixlTransferError
from prime_rl.inference.worker.reload import ModelReload


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
    reload = ModelReload(worker)
    try:
        stats = receiver.receive(version, reload.load)
    except Exception as e:
        reload.finish()
        if reload.count == 0:
            raise NixlTransferError(f"{e}; no tensor reached the model, version {served} {STILL_SERVED}") from e
        batches = receiver.rollback_batches()
        if batches is None:
            raise NixlTransferError(
                f"{e}; {reload.count} tensors were already loaded and there is no rollback copy "
                "(keep_rollback_copy = false, or no complete NIXL update yet): the model is partially updated, "
                "send a full update again"
            ) from e
        worker._prime_reload(batches)
        raise NixlTransferError(f"{e}; rolled back to version {served}, which {STILL_SERVED}") from e
    reload.finish()
    return {**stats, "tensors": reload.count}
