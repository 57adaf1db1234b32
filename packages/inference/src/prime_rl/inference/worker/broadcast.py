"""Broadcast (NCCL / gloo) updates inside a vLLM worker: stream into the model, verify, roll back.

A broadcast cannot be verified before it touches the model: it is never held whole (each bucket is
loaded as it arrives, so the update costs one bucket of extra memory, not a second model). What makes
it safe is the way back. With ``keep_rollback_copy`` the worker keeps the bytes of the last complete,
finite broadcast in host memory (one copy of the checkpoint-format weights, bf16 by default, per
worker); an update that fails midway (the trainer died, the group broke) or carried NaN/Inf is
finished and then replaced by reloading that copy. Without a copy (turned off, or before the first
complete broadcast) the worker says the model is partial and the controller reloads the weights it
knows on disk (the served model directory or the last filesystem update), as for a failed file load.

Messages of failures after which the previous version still serves contain ``STILL_SERVED``: the
controller keeps health ok for those (nothing is broken) and fails it for the others.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from prime_rl.common.weight_sync.broadcast import BucketLayout, WeightGroup, unpack_bucket
from prime_rl.common.weight_sync.pinned import pinned_empty
from prime_rl.inference.weights.broadcast_receiver import receive_batches
from prime_rl.inference.weights.manifest import STILL_SERVED
from prime_rl.inference.worker.reload import ModelReload


class BroadcastUpdateError(RuntimeError):
    """A broadcast update failed in the worker; the message says which weights serve now."""


@dataclass
class RollbackCopy:
    """Host bytes of one complete broadcast: bucket ``b`` of ``layout`` is ``buckets[b]``."""

    version: int
    layout: BucketLayout
    buckets: list[torch.Tensor]
    storage: list[torch.Tensor]
    """The host buffers ``buckets`` are views of: reused by the update after next (`HostBuffers`)."""

    def batches(self):
        return (unpack_bucket(self.layout, b, buf) for b, buf in enumerate(self.buckets))


class HostBuffers:
    """Host buffers for rollback copies, reused: a fresh 1 GiB pageable buffer per bucket cost page faults on
    every update (with the `.to("cpu")` copy, ~2.3 s of the 3.5 s a 1.7B ipc push took on the H200). Two sets live
    at a time: the copy of the served version (the way back while the next one streams in) and the one being
    filled; once an update completes, the older set becomes the spares. Pinned when the buckets are on a GPU."""

    def __init__(self, spares: list[torch.Tensor]) -> None:
        self.spares = spares
        self.taken: list[torch.Tensor] = []
        self.pin = False
        """The copies came from a GPU: the buffers are pinned."""

    def copy(self, buffer: torch.Tensor) -> torch.Tensor:
        """A host copy of ``buffer`` (a view of a reused buffer when one is large enough)."""
        n = buffer.numel()
        self.pin = self.pin or buffer.is_cuda
        base = self._take(self.spares, n, buffer.dtype)
        self.taken.append(base)
        view = base[:n]
        view.copy_(buffer)
        return view

    def spare_set(self) -> list[torch.Tensor]:
        """Buffers for the next update's copy, as large as the ones just taken: the unused spares where they fit,
        new ones otherwise. Made after the first update, so the second allocates nothing: it paid for pinning
        the whole set in its own step (1.6 s for the 1.7B shape on the H200, 6.9 s for the 8B shape)."""
        free = list(self.spares)
        return [self._take(free, t.numel(), t.dtype) for t in self.taken] + free

    def _take(self, pool: list[torch.Tensor], n: int, dtype: torch.dtype) -> torch.Tensor:
        """The first buffer of ``pool`` that holds ``n`` elements of ``dtype`` (removed from it), else a new one."""
        for i, t in enumerate(pool):
            if t.numel() >= n and t.dtype == dtype:
                return pool.pop(i)
        return pinned_empty(n, dtype, pin=self.pin)  # not rounded up to a power of two


_MINMAX_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
"""Float dtypes ``torch.aminmax`` (and ``isfinite``) support on CPU and CUDA; fp8 is upcast first."""


def _nonfinite(batch: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the float tensors of ``batch`` holding a NaN or an Inf.

    One min/max pass per tensor (min and max propagate NaN, and an Inf is an extreme), read back with one
    host sync for the whole batch. ``isfinite(t).all()`` wrote a bool copy of every tensor and synced after
    each: on CPU it was 2.3 s of a 4.9 s ipc update of a 1.1 GB model, and ``aminmax`` is ~12x faster."""
    named = [(name, t) for name, t in batch if t.is_floating_point() and t.numel() > 0]
    if not named:
        return []
    flags = [
        torch.stack(torch.aminmax(t if t.dtype in _MINMAX_DTYPES else t.float())).isfinite().all() for _, t in named
    ]
    finite = torch.stack(flags).tolist()
    return [name for (name, _), ok in zip(named, finite, strict=True) if not ok]


BucketSource = Callable[[Callable[[int, torch.Tensor], None]], Iterator[list[tuple[str, torch.Tensor]]]]
"""``source(on_bucket)`` yields each bucket's tensors, calling ``on_bucket(b, buffer)`` on its raw bytes first."""


def receive(
    worker: Any, group: WeightGroup, layout: BucketLayout, version: int, served: int, keep_rollback_copy: bool
) -> dict:
    """Receive ``version`` bucket by bucket over the broadcast group into the model (see ``load_buckets``)."""
    return load_buckets(
        worker, lambda on_bucket: receive_batches(group, layout, on_bucket=on_bucket), layout, version, served,
        keep_rollback_copy, copy=False,
    )  # fmt: skip


def load_buckets(
    worker: Any,
    source: BucketSource,
    layout: BucketLayout,
    version: int,
    served: int,
    keep_rollback_copy: bool,
    copy: bool,
) -> dict:
    """Load ``version`` bucket by bucket from ``source`` into the model; on failure restore
    ``worker._prime_bcast_copy``. Every streaming transport (broadcast, IPC) ends here.

    ``served``: the version serving before this update (named in messages). ``copy``: the buckets are reused
    by the source once the next one is asked for (IPC slots), so the reload keeps copies. Returns the load
    statistics; raises ``BroadcastUpdateError`` saying what serves now.
    """
    previous: RollbackCopy | None = worker._prime_bcast_copy
    host = HostBuffers(worker._prime_bcast_spares)
    worker._prime_bcast_spares = []
    kept: list[torch.Tensor] = []
    nonfinite: list[str] = []
    reload = ModelReload(worker, copy=copy)
    # seconds per phase, in the returned statistics (the server logs them with each update): on the H200 the
    # workers' part of a 1.7B ipc update was ~1.0 s of the colocated hand-over, and these say which part
    phases = dict.fromkeys(("receive", "rollback_copy", "check", "reload", "finish", "spares"), 0.0)

    def keep(bucket: int, buffer: torch.Tensor) -> None:
        if keep_rollback_copy:
            start = time.perf_counter()
            kept.append(host.copy(buffer))
            phases["rollback_copy"] += time.perf_counter() - start

    try:
        batches = iter(source(keep))
        while True:
            start = time.perf_counter()
            batch = next(batches, None)  # waiting for the bucket (and keeping its copy)
            phases["receive"] += time.perf_counter() - start
            if batch is None:
                break
            start = time.perf_counter()
            nonfinite += _nonfinite(batch)
            phases["check"] += time.perf_counter() - start
            start = time.perf_counter()
            reload.load(batch)  # every bucket is received and loaded: the sender broadcasts them all
            phases["reload"] += time.perf_counter() - start
        error = None
    except Exception as e:  # the group broke midway (a trainer died, a timeout)
        error = f"{type(e).__name__}: {e}"
    start = time.perf_counter()
    reload.finish()  # a reload left open would keep the model on the meta device
    phases["finish"] = time.perf_counter() - start
    if error is None and not nonfinite:
        worker._prime_bcast_copy = RollbackCopy(version, layout, kept, host.taken) if keep_rollback_copy else None
        start = time.perf_counter()
        if previous is not None:
            worker._prime_bcast_spares = previous.storage
        else:  # the first complete update (or the first after a file or NIXL load): the next one's set now
            worker._prime_bcast_spares = host.spare_set() if keep_rollback_copy else []
        phases["spares"] = time.perf_counter() - start
        phases["receive"] -= phases["rollback_copy"]  # the copies are made while a bucket is handed over
        stats = {"tensors": reload.count, "direct": reload.direct}
        return {**stats, **{f"{name}_s": round(t, 3) for name, t in phases.items()}}
    worker._prime_bcast_spares = host.taken + host.spares  # the failed update's copies are free again
    what = error or f"carried NaN/Inf in {len(nonfinite)} tensor(s) ({', '.join(nonfinite[:5])})"
    if reload.count == 0:
        raise BroadcastUpdateError(f"{what}; no tensor reached the model, version {served} {STILL_SERVED}")
    if previous is None:
        worker._prime_bcast_copy = None
        raise BroadcastUpdateError(
            f"{what}; {reload.count} tensors were already loaded and this worker holds no copy of the previous "
            "broadcast (keep_rollback_copy = false, or none completed yet): the model is partially updated"
        )
    worker._prime_reload(previous.batches())
    raise BroadcastUpdateError(f"{what}; rolled back to version {served}, which {STILL_SERVED}")
