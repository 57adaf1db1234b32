"""The sending end of the IPC weight transport: trainer rank 0 packs the full state dict into a ring of shared
buffers that the inference workers on the same host read (protocol: ``prime_rl.common.weight_sync.ipc``; the
receiving end: ``prime_rl.inference.weights.ipc_receiver``). On several nodes each node's local rank 0 has a
sender of its own for its node's servers (``prime_rl.trainer.rl.publish_ipc``).

Like ``WeightBroadcaster`` it exposes the three phases ``begin`` / ``send`` / ``finish`` (the sequence, shared with
it, is ``streamed_sender.StreamedSender``) so the publisher can leave the last (waiting for the engines' reload)
to a background thread. The session (slots, channel) is set
up on the first ``begin``, once the largest bucket is known; a later update with a bucket that no longer fits
(another model) opens a new session. Memory: ``num_slots`` buckets, on the GPU (``memory = "device"``) or in
/dev/shm (``"host"``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prime_rl.common.servers import ServerSet
from prime_rl.common.weight_sync.broadcast import BucketLayout, pack_into
from prime_rl.common.weight_sync.ipc import (
    DEFAULT_BUCKET_BYTES,
    NUM_SLOTS,
    IpcAborted,
    IpcChannel,
    allocate_slots,
    new_session,
    remove_slots,
)
from prime_rl.common.weight_transports import IPC
from prime_rl.common.wire import (
    InitIpcRequest,
    IpcSlot,
    WakeUpRequest,
)
from prime_rl.trainer.weights.streamed_sender import StreamedSender


class IpcWeightError(RuntimeError):
    """An inference server refused or failed an IPC update."""


class IpcWeightSender(StreamedSender):
    """Rank 0 of the trainer (of each node, on several): shares bucket slots with the inference servers on this
    host and fills them."""

    gave_up = (IpcWeightError,)  # a worker gave up: its server's AwaitWeightsRequest says why

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        host: str,
        port: int,
        memory: str,
        device: torch.device,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        num_slots: int = NUM_SLOTS,
        timeout_s: float = 600.0,
        keep_rollback_copy: bool = True,
    ) -> None:
        self.host, self.port, self.memory, self.device = host, port, memory, device
        self.bucket_bytes, self.num_slots, self.timeout_s = bucket_bytes, num_slots, timeout_s
        self.keep_rollback_copy = keep_rollback_copy
        self.servers = ServerSet(addresses, timeout_s, error=IpcWeightError)
        self.channel: IpcChannel | None = None
        self.buffers: list[torch.Tensor] = []
        self.slots: list[IpcSlot] = []
        self.num_workers = 0
        self.num_buckets: dict[int, int] = {}
        """Buckets of each version begun and not finished: ``finish`` clears their keys from the channel."""

    def _open_session(self, slot_bytes: int) -> None:
        self._close_session()
        session = new_session()
        if self.channel is None:  # the store outlives sessions: its port stays bound
            self.channel = IpcChannel.connect(self.host, self.port, session, True, self.timeout_s)
        self.channel.session = session
        self.buffers, self.slots = allocate_slots(self.memory, self.num_slots, slot_bytes, self.device, session)
        request = InitIpcRequest(
            host=self.host,
            port=self.port,
            session=session,
            memory=self.memory,
            slots=self.slots,
            keep_rollback_copy=self.keep_rollback_copy,
            timeout_s=self.timeout_s,
        )
        self.servers.request(request)
        self.num_workers = self.channel.num_workers()  # every worker registered before its server answered

    def wake_weights(self) -> None:
        """Colocated runs: every server wakes its weights (they sleep while the trainer steps), the buffers the
        push writes into; its KV cache stays asleep until the orchestrator learns the version is served."""
        self.servers.request(WakeUpRequest(tags=["weights"], by="trainer"))

    def begin(self, version: int, layout: BucketLayout) -> None:
        """Phase 1: (set up the session, then) every server validates the layout and its workers wait."""
        largest = max(layout.bucket_sizes, default=0)
        if not self.slots or self.slots[0].size < largest:
            self._open_session(max(largest, 1))
        request = IPC.begin_request(version, **layout.to_fields())
        self.servers.request(request)
        self.num_buckets[version] = len(layout.bucket_sizes)

    def send(self, version: int, layout: BucketLayout, tensors: Sequence[torch.Tensor]) -> None:
        """Phase 2: fill the slots bucket by bucket (``tensors`` indexed like ``layout.specs``); a slot is
        reused only once every worker has read the bucket in it."""
        channel = self.channel
        assert channel is not None, "begin() first"
        try:
            for b in range(len(layout.bucket_sizes)):
                if b >= self.num_slots:
                    channel.wait_acks(version, b - self.num_slots, self.num_workers, self.timeout_s)
                pack_into(layout, b, tensors, self.buffers[b % self.num_slots])
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()  # the bytes are there before "ready"
                channel.set_ready(version, b)
        except IpcAborted as e:  # a worker gave up: its server's AwaitWeightsRequest says why
            raise IpcWeightError(f"inference gave up IPC update to version {version}: {e}") from e
        except BaseException as e:
            channel.abort(version, f"the trainer failed sending: {type(e).__name__}: {e}")
            raise

    def finish(self, version: int) -> None:
        """Phase 3: wait until every server serves ``version``; raises if any failed."""
        try:
            for request in IPC.finish_requests(version):
                self.servers.request(request)
        finally:
            if self.channel is not None:
                self.channel.clear(version, self.num_buckets.pop(version, 0), self.num_workers)

    def _close_session(self) -> None:
        remove_slots(self.slots)
        self.buffers, self.slots = [], []

    def close(self) -> None:
        self._close_session()
        self.servers.close()
        self.channel = None
