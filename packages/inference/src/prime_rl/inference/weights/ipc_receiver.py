"""The receiving end of the IPC weight transport (protocol, slots and channel: ``prime_rl.common.weight_sync.ipc``;
the sending end: ``prime_rl.trainer.weights.ipc_sender``).

``IpcReceiver`` is what one vLLM worker holds for a trainer session: the trainer's slots opened once, its id
on the channel. ``batches`` yields each bucket's tensors as views of its slot and acknowledges the bucket
when the next one is asked for, so the trainer may overwrite the slot; a consumer that stops early (an error
while loading) aborts the version so the trainer stops at once. ``prime_rl.inference.worker.ipc`` loads the
batches into the model (with the broadcast transport's rollback). Pure torch: no vLLM here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from prime_rl.common.weight_sync.broadcast import BucketLayout, unpack_bucket
from prime_rl.common.weight_sync.ipc import IpcAborted, IpcChannel, open_slot
from prime_rl.common.wire import InitIpcRequest


class IpcReceiver:
    """One worker's end of an IPC session."""

    def __init__(self, request: InitIpcRequest) -> None:
        self.memory = request.memory
        self.timeout_s = request.timeout_s
        self.buffers = [open_slot(request.memory, slot) for slot in request.slots]
        self.channel = IpcChannel.connect(request.host, request.port, request.session, False, request.timeout_s)
        self.worker_id = self.channel.register_worker()

    def check(self, layout: BucketLayout) -> None:
        """Every bucket fits a slot (the API process checked the layout against the model already)."""
        size = self.buffers[0].numel()
        if (largest := max(layout.bucket_sizes, default=0)) > size:
            raise ValueError(f"a bucket of {largest} bytes does not fit the session's {size}-byte slots")

    def batches(
        self, layout: BucketLayout, version: int, on_bucket: Callable[[int, torch.Tensor], None] | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Each bucket's tensors, in order, as views of its slot (valid until the next one is asked for).
        ``on_bucket(b, bytes)`` sees each bucket's raw bytes first (the worker's rollback copy)."""
        self.check(layout)
        num_slots = len(self.buffers)
        b = -1
        try:
            for b, size in enumerate(layout.bucket_sizes):
                self.channel.wait_ready(version, b, self.timeout_s)
                buffer = self.buffers[b % num_slots][:size]
                if on_bucket is not None:
                    on_bucket(b, buffer)
                yield unpack_bucket(layout, b, buffer)
                if buffer.is_cuda:  # the copies out of the slot (on its GPU and on this worker's) are done
                    torch.cuda.synchronize(buffer.device)
                    torch.cuda.synchronize()
                self.channel.ack(version, b, self.worker_id)
        except IpcAborted:
            raise  # the trainer gave up: its reason stays in the channel
        except BaseException as e:  # GeneratorExit too: the loader stopped, the trainer must not wait for acks
            reason = "the loader stopped" if isinstance(e, GeneratorExit) else f"{type(e).__name__}: {e}"
            self.channel.abort(version, f"inference worker {self.worker_id} gave up at bucket {b}: {reason}")
            raise

    def close(self) -> None:
        self.buffers = []
