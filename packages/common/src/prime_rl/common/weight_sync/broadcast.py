"""The broadcast weight transport's protocol: the group both ends build and the bucket layout.

The sending end is ``prime_rl.trainer.weights.broadcast_sender`` (``WeightBroadcaster``, ``send_buckets``),
the receiving end ``prime_rl.inference.weights.broadcast_receiver`` (``receive_batches``, called by the vLLM
workers through ``prime_rl.inference.worker``; the server's side of the control requests is
``prime_rl.inference.control``). What both must agree on lives here:

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
   server refuses anything else before any data moves. ``pack_bucket`` / ``unpack_bucket`` are the two
   directions of that byte placement.
3. Round. ``BroadcastWeightsRequest`` to every server (answered after validation, once the workers
   wait) -> broadcast bucket 0, 1, ... from rank 0 as flat uint8 tensors -> ``AwaitWeightsRequest`` to
   every server (answered when the weights are loaded and the version is live).

Depends on torch and ``prime_rl.common`` only: no vLLM, no trainer or inference code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from prime_rl.common.weight_layout import ALIGNMENT as BUCKET_ALIGNMENT
from prime_rl.common.weight_layout import dtype_name, pack_aligned
from prime_rl.common.wire import TensorSpec, tensor_bytes

STORE_PREFIX = "prime_rl/weight_broadcast"
"""Keys in the TCP store are namespaced so the store could be shared with other rendezvous users."""
DEFAULT_BUCKET_BYTES = 256 << 20  # best of 64 MiB / 256 MiB / 1 GiB on 2 H200 (benchmarks/results/weight_transfer.md)


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
        return tensor_bytes(self.dtype, self.shape)

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

    def to_fields(self) -> dict[str, list]:
        """The layout fields of ``BroadcastWeightsRequest`` / ``IpcWeightsRequest``:
        ``BroadcastWeightsRequest(version=v, **layout.to_fields())``."""
        return {
            "specs": [TensorSpec(name=s.name, dtype=s.dtype, shape=list(s.shape)) for s in self.specs],
            "buckets": self.buckets,
            "offsets": self.offsets,
            "bucket_sizes": self.bucket_sizes,
        }

    @classmethod
    def from_fields(
        cls,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        buckets: list[int],
        offsets: list[int],
        bucket_sizes: list[int],
    ) -> BucketLayout:
        """The layout ``to_fields`` sent, as a worker receives it: the API process validated the request and
        passes its specs on as columns (``prime_rl.inference.weights.push.begin_streamed``)."""
        specs = [Spec(n, d, tuple(shape)) for n, d, shape in zip(names, dtypes, shapes)]
        return cls(specs, buckets, offsets, bucket_sizes)


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
    return pack_into(layout, bucket, tensors, buffer)


def pack_into(layout: BucketLayout, bucket: int, tensors: Sequence[torch.Tensor], buffer: torch.Tensor) -> torch.Tensor:
    """Write bucket ``bucket``'s tensors into the first bytes of ``buffer`` (flat uint8, big enough): the
    IPC transport's shared slots are reused across buckets. Returns the bucket's bytes."""
    if buffer.numel() < layout.bucket_sizes[bucket]:
        raise ValueError(f"bucket {bucket} needs {layout.bucket_sizes[bucket]} bytes; the buffer has {buffer.numel()}")
    for i in layout.tensors_of(bucket):
        t = tensors[i]
        off = layout.offsets[i]
        buffer[off : off + layout.specs[i].num_bytes].view(t.dtype).copy_(t.reshape(-1), non_blocking=True)
    return buffer[: layout.bucket_sizes[bucket]]


def unpack_bucket(layout: BucketLayout, bucket: int, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of the tensors in a received bucket (no copy)."""
    out = []
    for i in layout.tensors_of(bucket):
        spec = layout.specs[i]
        off = layout.offsets[i]
        out.append((spec.name, buffer[off : off + spec.num_bytes].view(getattr(torch, spec.dtype)).view(spec.shape)))
    return out
