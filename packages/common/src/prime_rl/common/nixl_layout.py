"""The shared arithmetic of the NIXL weight transport: transfer groups, per-rank slices, notifications.

Both ends compute the same thing from the same ``NixlLayout`` (pure Python, no torch, no NIXL), so
they never disagree about where a byte lives:

- Groups. Tensors, in transfer order, are packed into groups of at most ``group_bytes`` (a larger
  tensor gets a group of its own); each tensor starts at a multiple of 256 bytes (``weight_layout``'s
  packer, the broadcast buckets' too). A group is the unit that is received and then loaded into the
  engine; a transfer arena holds one group.
- Slices. Group ``g`` is cut into ``num_sources`` contiguous, 256-byte aligned slices: trainer rank
  ``r`` stages slice ``r`` in its slot and every receiver reads all non-empty slices of the group
  (one read per trainer rank, all posted at once, starting at a different rank per receiver).
- Notifications (NIXL notifications, so they travel on the same connection as the data):
  ``R:<version>:<group>:<slot>`` trainer rank -> receiver: "my slice of this group is staged";
  ``C:<version>:<group>:<slot>`` receiver -> trainer rank, attached to the read itself, so it is
  delivered when the read completes: "slot free again" (the buffer credit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from prime_rl.common.weight_layout import ALIGNMENT, align_up, pack_aligned
from prime_rl.common.wire import DTYPE_ITEMSIZE, NixlLayout, TensorSpec, tensor_bytes

DEFAULT_GROUP_BYTES = 256 << 20

ITEMSIZE = DTYPE_ITEMSIZE  # one table for every transport, in prime_rl.common.wire

READY = "R"
CREDIT = "C"


class NixlProtocolError(RuntimeError):
    """A peer broke the transfer protocol (wrong version, unknown group, malformed notification)."""


def num_bytes(spec: TensorSpec) -> int:
    if spec.dtype not in ITEMSIZE:
        raise ValueError(f"tensor {spec.name} has dtype {spec.dtype!r}; supported: {sorted(ITEMSIZE)}")
    return tensor_bytes(spec.dtype, spec.shape)


def plan_layout(
    specs: Sequence[TensorSpec], num_sources: int, group_bytes: int = DEFAULT_GROUP_BYTES, num_slots: int = 1
) -> NixlLayout:
    """Pack ``specs`` in order into groups of at most ``group_bytes`` (a bigger tensor gets its own)."""
    if group_bytes < ALIGNMENT:
        raise ValueError(f"group_bytes={group_bytes} is below the {ALIGNMENT}-byte alignment; use >= 1 MiB")
    if num_sources < 1 or num_slots not in (1, 2):
        raise ValueError(f"num_sources={num_sources} must be >= 1 and num_slots={num_slots} 1 or 2")
    groups, offsets, sizes = pack_aligned((num_bytes(spec) for spec in specs), group_bytes)
    return NixlLayout(
        specs=list(specs),
        groups=groups,
        offsets=offsets,
        group_sizes=sizes,
        num_sources=num_sources,
        num_slots=num_slots,
    )


def source_slices(group_size: int, num_sources: int) -> list[tuple[int, int]]:
    """``[(start, end))`` byte range of the group that each trainer rank stages; trailing ones may be empty."""
    piece = align_up(-(-group_size // num_sources))
    return [(min(r * piece, group_size), min((r + 1) * piece, group_size)) for r in range(num_sources)]


def max_slice_bytes(layout: NixlLayout, rank: int) -> int:
    """Slot size trainer rank ``rank`` needs: its largest slice over all groups."""
    return max((e - s for g in layout.group_sizes for s, e in [source_slices(g, layout.num_sources)[rank]]), default=0)


def read_order(receiver_rank: int, num_sources: int) -> list[int]:
    """Trainer ranks in the order a receiver posts its reads: starting at its own, so sources share the load."""
    start = receiver_rank % num_sources
    return [(start + i) % num_sources for i in range(num_sources)]


class Piece(NamedTuple):
    """Part of tensor ``index`` that falls into a byte range: ``[tensor_start, tensor_end)`` of the tensor's
    bytes lands at ``dest`` of that range."""

    index: int
    tensor_start: int
    tensor_end: int
    dest: int


def pieces_in_range(layout: NixlLayout, group: int, start: int, end: int) -> list[Piece]:
    """The tensor bytes a trainer rank copies into its slot for bytes ``[start, end)`` of ``group``."""
    out = []
    for i, g in enumerate(layout.groups):
        if g != group:
            continue
        t0 = layout.offsets[i]
        t1 = t0 + num_bytes(layout.specs[i])
        lo, hi = max(t0, start), min(t1, end)
        if lo < hi:
            out.append(Piece(i, lo - t0, hi - t0, lo - start))
    return out


class Note(NamedTuple):
    kind: str
    version: int
    group: int
    slot: int


def encode_note(kind: str, version: int, group: int, slot: int) -> bytes:
    return f"{kind}:{version}:{group}:{slot}".encode()


def decode_note(raw: bytes, sender: str) -> Note:
    try:
        kind, version, group, slot = raw.decode().split(":")
        if kind not in (READY, CREDIT):
            raise ValueError(kind)
        return Note(kind, int(version), int(group), int(slot))
    except (UnicodeDecodeError, ValueError) as e:
        raise NixlProtocolError(
            f"malformed NIXL notification {raw[:64]!r} from {sender}: expected b'R|C:<version>:<group>:<slot>'"
        ) from e
