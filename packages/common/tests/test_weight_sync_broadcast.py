"""The broadcast transport's protocol shared by trainer and inference: the bucket layout.

The round trip of the two ends (the trainer's sender, inference's receivers) is tests/test_weight_broadcast.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="prime_rl.common.weight_sync needs prime-rl-common[torch]")

from prime_rl.common.weight_sync.broadcast import (  # noqa: E402
    BUCKET_ALIGNMENT,
    BucketLayout,
    Spec,
    plan_buckets,
)
from prime_rl.common.wire import BroadcastWeightsRequest, decode, encode  # noqa: E402


def _state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(50, 16, generator=g).to(torch.bfloat16),
        "odd": torch.randn(3, 5, generator=g),  # 60 bytes: the next tensor must be re-aligned
        "big": torch.randn(300, 40, generator=g),  # 48000 bytes > bucket: a bucket of its own
        "norm": torch.randn(7, generator=g).to(torch.float16),
        "ids": torch.arange(11, dtype=torch.int64),
    }


def test_layout_aligns_packs_in_order_and_isolates_big_tensors():
    specs = [Spec.of(n, t) for n, t in _state_dict().items()]
    layout = plan_buckets(specs, bucket_bytes=4096)
    assert layout.buckets == sorted(layout.buckets)
    assert all(off % BUCKET_ALIGNMENT == 0 for off in layout.offsets)
    big = [s.name for s in specs].index("big")
    assert layout.tensors_of(layout.buckets[big]) == [big] and layout.bucket_sizes[layout.buckets[big]] == 48000
    for b, size in enumerate(layout.bucket_sizes):
        members = layout.tensors_of(b)
        ends = [layout.offsets[i] + specs[i].num_bytes for i in members]
        assert max(ends) == size and (size <= 4096 or len(members) == 1)
        for i, j in zip(members, members[1:]):
            assert layout.offsets[j] >= layout.offsets[i] + specs[i].num_bytes  # no overlap


def test_layout_fields_round_trip_through_the_request():
    """The sender puts ``to_fields`` in the request; the API process passes the specs on as columns, from which
    a worker rebuilds the same layout."""
    layout = plan_buckets([Spec.of(n, t) for n, t in _state_dict().items()], bucket_bytes=4096)
    request = decode(encode(BroadcastWeightsRequest(version=3, **layout.to_fields())))
    columns = [s.name for s in request.specs], [s.dtype for s in request.specs], [s.shape for s in request.specs]
    rebuilt = BucketLayout.from_fields(*columns, request.buckets, request.offsets, request.bucket_sizes)
    assert rebuilt == layout
