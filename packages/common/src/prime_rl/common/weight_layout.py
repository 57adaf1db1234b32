"""Byte layout shared by both weight transports: the alignment, the aligned packer and the dtype names and codes.

A broadcast bucket (``weight_sync.broadcast``) and a NIXL transfer group (``nixl_layout``) are packed by
the same rule, ``pack_aligned``: tensors in order, each starting at a multiple of ``ALIGNMENT`` bytes, a new
bin when the next tensor would overflow ``max_bytes`` (a larger tensor gets a bin of its own). The
receivers' checks (``prime_rl.inference.weights.manifest``) enforce the same alignment.

Pure Python, no torch: the torch-free modules (``nixl_layout``, inference's API process) use it, and they
may not import the torch-level ``prime_rl.common.weight_sync`` package (tests/test_boundaries.py). The
dtype table is ``wire.DTYPE_ITEMSIZE`` (torch names); ``dtype_name`` maps a torch dtype onto it, as
``wire.dtype_name`` does for numpy (whose names agree wherever numpy has the dtype), and ``SAFETENSORS_DTYPES``
maps the safetensors files' dtype codes onto it (the trainer writes them, inference reads them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

ALIGNMENT = 256
"""Every tensor (and every NIXL slice) starts at a multiple of this many bytes."""

SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
"""safetensors dtype code -> dtype name (a key of ``wire.DTYPE_ITEMSIZE``): the codes the trainer writes
(``prime_rl.trainer.weights.files``) and inference reads (``prime_rl.inference.weights.manifest``)."""


def align_up(num_bytes: int) -> int:
    """``num_bytes`` rounded up to a multiple of ``ALIGNMENT``."""
    return -(-num_bytes // ALIGNMENT) * ALIGNMENT


def dtype_name(dtype: torch.dtype) -> str:
    """The name a ``TensorSpec`` carries for a torch dtype: "bfloat16" for ``torch.bfloat16`` (a key of
    ``wire.DTYPE_ITEMSIZE``)."""
    return str(dtype).removeprefix("torch.")


class PackedLayout(NamedTuple):
    """Where ``pack_aligned`` put each tensor: its bin and byte offset, and each bin's size."""

    bins: list[int]
    offsets: list[int]
    sizes: list[int]


def pack_aligned(num_bytes: Iterable[int], max_bytes: int) -> PackedLayout:
    """Pack tensors of ``num_bytes`` in order into bins of at most ``max_bytes`` (a bigger tensor gets its own).

    The caller checks ``max_bytes >= ALIGNMENT`` (its error names its own setting)."""
    bins: list[int] = []
    offsets: list[int] = []
    sizes: list[int] = []
    end = 0
    for size in num_bytes:
        start = align_up(end)
        if not sizes or (start + size > max_bytes and end > 0):
            sizes.append(0)
            start = 0
        bins.append(len(sizes) - 1)
        offsets.append(start)
        end = start + size
        sizes[-1] = end
    return PackedLayout(bins, offsets, sizes)
