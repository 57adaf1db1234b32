"""Per-tensor CRC32s summed in pieces and merged (``crc32_combine``) equal zlib's CRC of the whole bytes."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
from safetensors.numpy import save_file

from prime_rl.common import weight_checksum
from prime_rl.common.weight_checksum import combine_piece_crcs, compute_checksums, crc32_combine, split_range


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 255, 4096, 100_003])
def test_combine_of_a_random_split_is_the_crc_of_the_whole(size):
    rng = random.Random(size)
    data = rng.randbytes(size)
    for _ in range(20):
        cut = rng.randint(0, size)
        a, b = data[:cut], data[cut:]
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data)


def test_combine_of_many_pieces_and_empty_ones():
    rng = random.Random(0)
    data = rng.randbytes(50_000)
    cuts = sorted(rng.randint(0, len(data)) for _ in range(30)) + [0, 0, len(data)]  # repeated cuts: empty pieces
    bounds = [0, *sorted(cuts), len(data)]
    pieces = [(zlib.crc32(data[a:b]), b - a) for a, b in zip(bounds, bounds[1:])]
    assert combine_piece_crcs(pieces) == zlib.crc32(data)
    assert combine_piece_crcs([]) == zlib.crc32(b"") == 0


def test_combine_over_lengths_with_high_bits():
    # a long run of zero bytes: crc32 of it is cheap to get directly, and the length exercises high operators
    zeros = bytes(3 << 20)
    head = b"prime-rl"
    assert crc32_combine(zlib.crc32(head), zlib.crc32(zeros), len(zeros)) == zlib.crc32(head + zeros)


def test_combine_rejects_a_negative_length():
    with pytest.raises(ValueError, match="len2=-1"):
        crc32_combine(0, 0, -1)


def test_split_range_covers_the_range_in_order():
    assert split_range(10, 35, 10) == [(10, 20), (20, 30), (30, 35)]
    assert split_range(5, 5, 10) == [(5, 5)]


def test_checksums_from_pieces_equal_whole_tensor_crcs(tmp_path, monkeypatch):
    monkeypatch.setattr(weight_checksum, "PIECE_BYTES", 1000)  # several pieces per tensor, summed by several threads
    rng = np.random.default_rng(0)
    tensors = {
        "big": rng.standard_normal((97, 31)).astype(np.float32),
        "small": rng.standard_normal((3,)).astype(np.float16),
        "empty": np.zeros((0,), np.float32),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert compute_checksums(tmp_path) == {name: zlib.crc32(t.tobytes()) for name, t in tensors.items()}
