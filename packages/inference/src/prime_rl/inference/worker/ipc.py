"""IPC updates inside a vLLM worker: open the trainer's shared slots once, then stream each version into the model.

The data path is the broadcast transport's (``worker.broadcast.load_buckets``): each bucket is loaded as it
is read, NaN/Inf or a trainer that stops midway is rolled back from the host copy of the last complete
streamed update (``keep_rollback_copy``), and without a copy the controller restores the weights on disk.
Only the source differs: views of the trainer's slots (``prime_rl.inference.weights.ipc_receiver``), which
the reload must copy because the trainer reuses a slot once it is acknowledged.
"""

from __future__ import annotations

from typing import Any

from prime_rl.common.weight_sync.broadcast import BucketLayout
from prime_rl.common.wire import InitIpcRequest
from prime_rl.inference.weights.ipc_receiver import IpcReceiver
from prime_rl.inference.worker.broadcast import load_buckets


def init_receiver(worker: Any, request: InitIpcRequest) -> dict:
    """Open the session's slots in ``worker`` (replacing an older session's)."""
    close_receiver(worker)
    worker._prime_ipc = IpcReceiver(request)
    worker._prime_bcast_keep = request.keep_rollback_copy
    if not request.keep_rollback_copy:
        worker._prime_bcast_copy = None
    return {"worker_id": worker._prime_ipc.worker_id, "slots": len(request.slots), "memory": request.memory}


def close_receiver(worker: Any) -> None:
    if worker._prime_ipc is not None:
        worker._prime_ipc.close()
        worker._prime_ipc = None


def receive(worker: Any, layout: BucketLayout, version: int, served: int) -> dict:
    """Load ``version`` from the slots; raises ``BroadcastUpdateError`` saying what serves after a failure."""
    receiver: IpcReceiver | None = worker._prime_ipc
    if receiver is None:
        raise RuntimeError("no IPC session: send InitIpcRequest before IpcWeightsRequest")
    return load_buckets(
        worker,
        lambda on_bucket: receiver.batches(layout, version, on_bucket),
        layout,
        version,
        served,
        worker._prime_bcast_keep,
        copy=True,
    )
