"""The receiving end of the broadcast weight transport (protocol, group and bucket layout:
``prime_rl.common.weight_sync.broadcast``; the sending end: ``prime_rl.trainer.weights.broadcast_sender``).

``receive_batches`` is what a vLLM worker runs (``prime_rl.inference.worker.broadcast`` loads each batch
into the model and keeps the rollback copy); ``receive_buckets`` collects a whole update in a plain torch
process (tests, benchmarks). Pure torch: no vLLM here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from prime_rl.common.weight_sync.broadcast import BucketLayout, WeightGroup, unpack_bucket


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
