"""The broadcast weight transport, both ends: one trainer rank pushes a state dict into inference workers.

Protocol (the inference server's side of the control requests is ``prime_rl.inference.control``; its
workers call ``receive_batches`` from ``prime_rl.inference.worker.extension``):

1. Group. The trainer's sending rank is rank 0 of a fresh process group (gloo on CPU, NCCL on GPU) built
   from a TCP store it hosts at ``host:port``; inference server ``s`` joins with ``InitBroadcastRequest``
   and its workers take ranks ``rank_offset_s + 0 .. rank_offset_s + workers_s - 1`` (workers = dp * tp
   of that server). The group lives outside ``torch.distributed``'s global state, so a torchrun
   trainer's (and vLLM's) default group is untouched. Both ends build it with ``build_weight_group``.
2. Layout. Tensors go in the caller's order, packed into byte buckets of at most ``bucket_bytes``
   (a larger tensor gets a bucket of its own); each starts at a multiple of 256 bytes
   (``prime_rl.common.weight_layout.pack_aligned``, the NIXL groups' packer too). The layout
   (bucket id, byte offset per tensor, bucket sizes) travels in ``BroadcastWeightsRequest`` with each
   tensor's HF name, dtype (torch name: "bfloat16", "float32", ...) and shape, so the receiver never
   re-derives it. Dtypes must equal the served model's dtype and names/shapes its HF checkpoint: the
   server refuses anything else before any data moves.
3. Round. ``BroadcastWeightsRequest`` to every server (answered after validation, once the workers
   wait) -> broadcast bucket 0, 1, ... from rank 0 as flat uint8 tensors -> ``AwaitWeightsRequest`` to
   every server (answered when the weights are loaded and the version is live). ``WeightBroadcaster``
   exposes the three phases (``begin`` / ``send`` / ``finish``) so a publisher can leave the last one,
   which waits for the engines' reload, to a background thread.

Packing bucket ``i + 1`` overlaps the broadcast of bucket ``i`` on GPU (NCCL runs on its own stream);
at most two buckets are in flight, so the extra memory is two buckets.

Depends on torch and ``prime_rl.common`` only: no vLLM, no trainer code.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from prime_rl.common.weight_layout import ALIGNMENT as BUCKET_ALIGNMENT
from prime_rl.common.weight_layout import dtype_name, pack_aligned
from prime_rl.common.weight_sync.servers import InferenceServers
from prime_rl.common.wire import AwaitWeightsRequest, BroadcastWeightsRequest, InitBroadcastRequest, TensorSpec

STORE_PREFIX = "prime_rl/weight_broadcast"
"""Keys in the TCP store are namespaced so the store could be shared with other rendezvous users."""
DEFAULT_BUCKET_BYTES = 256 << 20  # best of 64 MiB / 256 MiB / 1 GiB on 2 H200 (benchmarks/results/weight_transfer.md)


class WeightBroadcastError(RuntimeError):
    """An inference server refused or failed a broadcast step."""


# -- the group -----------------------------------------------------------------------------------


@dataclass
class WeightGroup:
    """The group plus the TCP store it was built from (rank 0's store hosts the rendezvous server)."""

    pg: dist.ProcessGroup
    store: dist.TCPStore
    device: torch.device
    rank: int
    world_size: int

    def broadcast(self, tensor: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """Receive (or, on rank 0, send) ``tensor`` in place from rank 0."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        work = self.pg.broadcast([tensor], opts)
        if async_op:
            return work
        work.wait()
        return None

    def close(self) -> None:
        self.pg.shutdown()


def build_weight_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> WeightGroup:
    """Join the weight-broadcast group; blocks until all ``world_size`` ranks have joined."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight broadcast backend={backend!r} is not supported; use 'gloo' (CPU) or 'nccl' (GPU)")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    prefix_store = dist.PrefixStore(STORE_PREFIX, store)
    pg = dist.ProcessGroup(prefix_store, rank, world_size)
    if backend == "gloo":
        backend_obj = dist.ProcessGroupGloo(prefix_store, rank, world_size, timeout)
        backend_type, device = dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend_obj = dist.ProcessGroupNCCL(prefix_store, rank, world_size, options)
        backend_type, device = dist.ProcessGroup.BackendType.NCCL, torch.device("cuda", torch.cuda.current_device())
    pg._set_default_backend(backend_type)
    backend_obj._set_sequence_number_for_group()
    pg._register_backend(device, backend_type, backend_obj)
    group = WeightGroup(pg=pg, store=store, device=device, rank=rank, world_size=world_size)
    group.broadcast(torch.ones(1, device=device))  # wait here until the whole group is up
    return group


# -- layout --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One tensor of an update: HF name, torch dtype name ("bfloat16"), shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * getattr(torch, self.dtype).itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> Spec:
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape))


@dataclass
class BucketLayout:
    """Where every tensor sits in the byte buckets; the layout fields of ``BroadcastWeightsRequest``."""

    specs: list[Spec]
    buckets: list[int]
    offsets: list[int]
    bucket_sizes: list[int]

    def tensors_of(self, bucket: int) -> list[int]:
        return [i for i, b in enumerate(self.buckets) if b == bucket]


def plan_buckets(specs: Sequence[Spec], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> BucketLayout:
    """Pack tensors in order into buckets of at most ``bucket_bytes`` (a bigger tensor gets its own)."""
    if bucket_bytes < BUCKET_ALIGNMENT:
        raise ValueError(f"bucket_bytes={bucket_bytes} is below the {BUCKET_ALIGNMENT}-byte alignment; use >= 1 MiB")
    buckets, offsets, sizes = pack_aligned((spec.num_bytes for spec in specs), bucket_bytes)
    return BucketLayout(list(specs), buckets, offsets, sizes)


def pack_bucket(
    layout: BucketLayout, bucket: int, tensors: Sequence[torch.Tensor], device: torch.device
) -> torch.Tensor:
    """One flat uint8 bucket holding its tensors (``tensors`` is indexed like ``layout.specs``)."""
    buffer = torch.empty(layout.bucket_sizes[bucket], dtype=torch.uint8, device=device)
    for i in layout.tensors_of(bucket):
        t = tensors[i]
        off = layout.offsets[i]
        buffer[off : off + layout.specs[i].num_bytes].view(t.dtype).copy_(t.reshape(-1), non_blocking=True)
    return buffer


def unpack_bucket(layout: BucketLayout, bucket: int, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of the tensors in a received bucket (no copy)."""
    out = []
    for i in layout.tensors_of(bucket):
        spec = layout.specs[i]
        off = layout.offsets[i]
        out.append((spec.name, buffer[off : off + spec.num_bytes].view(getattr(torch, spec.dtype)).view(spec.shape)))
    return out


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


def receive_buckets(group: WeightGroup, layout: BucketLayout) -> dict[str, torch.Tensor]:
    """The receiving end of ``send_buckets`` for a plain torch process (tests, benchmarks)."""
    out: dict[str, torch.Tensor] = {}
    for b, size in enumerate(layout.bucket_sizes):
        buffer = torch.empty(size, dtype=torch.uint8, device=group.device)
        group.broadcast(buffer)
        out.update(unpack_bucket(layout, b, buffer))
    return out


def receive_batches(
    group: WeightGroup, layout: BucketLayout, on_bucket: Callable[[int, torch.Tensor], None] | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Receive bucket by bucket (an inference worker's end of ``send_buckets``): yields the tensors of
    each bucket as views of it, so a worker loads one bucket while holding no more than one.
    ``on_bucket(b, buffer)`` sees each raw bucket first (the worker's rollback copy)."""
    for b, size in enumerate(layout.bucket_sizes):
        buffer = torch.empty(size, dtype=torch.uint8, device=group.device)
        group.broadcast(buffer)
        if on_bucket is not None:
            on_bucket(b, buffer)
        yield unpack_bucket(layout, b, buffer)


# -- the round trip with inference servers -------------------------------------------------------


class WeightBroadcaster:
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
        self.servers = InferenceServers(self.addresses, timeout_s, WeightBroadcastError)
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

    def plan(self, named_specs: Iterable[Spec]) -> BucketLayout:
        """The bucket layout of an update with these tensor specs (in send order)."""
        return plan_buckets(list(named_specs), self.bucket_bytes)

    def begin(self, version: int, layout: BucketLayout) -> None:
        """Phase 1: every server validates the layout and its workers wait for the buckets."""
        if self.group is None:
            raise WeightBroadcastError("call connect() before pushing weights")
        request = BroadcastWeightsRequest(
            version=version,
            specs=[TensorSpec(name=s.name, dtype=s.dtype, shape=list(s.shape)) for s in layout.specs],
            buckets=layout.buckets,
            offsets=layout.offsets,
            bucket_sizes=layout.bucket_sizes,
        )
        # Servers validate identically (same checkpoint), so either all accept or all refuse.
        self.servers.request(lambda i: request, "BroadcastWeightsRequest")

    def send(self, layout: BucketLayout, tensors: Sequence[torch.Tensor]) -> None:
        """Phase 2: broadcast the buckets (``tensors`` indexed like ``layout.specs``)."""
        assert self.group is not None
        send_buckets(self.group, layout, tensors)

    def finish(self, version: int) -> None:
        """Phase 3: wait until every server has loaded ``version`` and serves it; raises if any failed."""
        self.servers.request(lambda i: AwaitWeightsRequest(version=version), "AwaitWeightsRequest")

    def push(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> BucketLayout:
        """Send one full update; returns when every server serves ``version``. Raises if any refuses."""
        specs, tensors = [], []
        for name, t in named_tensors:
            t = t.detach().contiguous()
            specs.append(Spec.of(name, t))
            tensors.append(t)
        layout = self.plan(specs)
        self.begin(version, layout)
        self.send(layout, tensors)
        self.finish(version)
        return layout

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self.servers.close()
