"""The sending end of the broadcast weight transport: the trainer's rank 0 pushes a state dict into the
inference workers (protocol, group and bucket layout: ``prime_rl.common.weight_sync.broadcast``; the
receiving end: ``prime_rl.inference.weights.broadcast_receiver``).

``WeightBroadcaster`` drives a round with every inference server and exposes its three phases (``begin`` /
``send`` / ``finish``; the sequence, shared with the IPC sender, is ``streamed_sender.StreamedSender``) so a
publisher can leave the last one, which waits for the engines' reload, to a background thread. Packing bucket ``i + 1`` overlaps the broadcast of bucket ``i`` on GPU (NCCL runs on
its own stream); at most two buckets are in flight, so the extra memory is two buckets.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist

from prime_rl.common.servers import ServerSet
from prime_rl.common.weight_sync.broadcast import (
    DEFAULT_BUCKET_BYTES,
    BucketLayout,
    WeightGroup,
    build_weight_group,
    pack_bucket,
)
from prime_rl.common.weight_transports import NCCL
from prime_rl.common.wire import InitBroadcastRequest
from prime_rl.trainer.weights.streamed_sender import StreamedSender


class WeightBroadcastError(RuntimeError):
    """An inference server refused or failed a broadcast step."""


def send_buckets(
    group: WeightGroup, layout: BucketLayout, tensors: Sequence[torch.Tensor], max_in_flight: int = 2
) -> None:
    """Broadcast every bucket from rank 0, packing the next while the previous ones are on the wire."""
    pending: deque[dist.Work] = deque()
    for b in range(len(layout.bucket_sizes)):
        if len(pending) >= max_in_flight:
            pending.popleft().wait()
        buffer = pack_bucket(layout, b, tensors, group.device)
        pending.append(group.broadcast(buffer, async_op=True))
    while pending:
        pending.popleft().wait()


class WeightBroadcaster(StreamedSender):
    """Rank 0 of the trainer: joins the group with every inference server and pushes weights to them.

    ``addresses``: control endpoints (``tcp://host:port``) of the inference servers; ``workers_per_server``:
    vLLM workers of each (dp * tp; default 1 each).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        host: str,
        port: int,
        backend: str = "nccl",
        workers_per_server: Sequence[int] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 600.0,
        keep_rollback_copy: bool = True,
    ) -> None:
        self.addresses = list(addresses)
        self.keep_rollback_copy = keep_rollback_copy
        self.workers = list(workers_per_server or [1] * len(self.addresses))
        if len(self.workers) != len(self.addresses):
            raise ValueError(
                f"{len(self.workers)} worker counts for {len(self.addresses)} servers; give one per server"
            )
        self.host, self.port, self.backend = host, port, backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.servers = ServerSet(self.addresses, timeout_s, error=WeightBroadcastError)
        self.group: WeightGroup | None = None

    def connect(self) -> None:
        """Build the group: every server joins (in the background) while this process hosts the rendezvous."""
        world_size = 1 + sum(self.workers)
        offsets = [1 + sum(self.workers[:i]) for i in range(len(self.workers))]
        joined = self.servers.start(
            lambda i: InitBroadcastRequest(
                host=self.host,
                port=self.port,
                world_size=world_size,
                rank_offset=offsets[i],
                backend=self.backend,
                keep_rollback_copy=self.keep_rollback_copy,
            ),
            "InitBroadcastRequest",
        )
        self.group = build_weight_group(self.host, self.port, 0, world_size, self.backend, self.timeout_s)
        joined()

    def begin(self, version: int, layout: BucketLayout) -> None:
        """Phase 1: every server validates the layout and its workers wait for the buckets."""
        if self.group is None:
            raise WeightBroadcastError("call connect() before pushing weights")
        request = NCCL.begin_request(version, **layout.to_fields())
        # Servers validate identically (same checkpoint), so either all accept or all refuse.
        self.servers.request(request)

    def send(self, version: int, layout: BucketLayout, tensors: Sequence[torch.Tensor]) -> None:
        """Phase 2: broadcast the buckets (``tensors`` indexed like ``layout.specs``)."""
        assert self.group is not None
        send_buckets(self.group, layout, tensors)

    def finish(self, version: int) -> None:
        """Phase 3: wait until every server has loaded ``version`` and serves it; raises if any failed."""
        for request in NCCL.finish_requests(version):
            self.servers.request(request)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self.servers.close()
