"""Read every byte of a weights directory before the engine sees it: sizes, checksums, finite values.

The manifest check (``manifest.py``) reads only headers, so a file with an intact header and truncated
or corrupt data passed it, and the engine failed half-way through the reload with its parameters left
on the meta device. This check runs in a thread of the API process while the old weights keep serving;
only a directory that passes it is handed to the workers.

1. Sizes: every safetensors file is exactly ``8 + header + data`` bytes and each tensor's byte range
   matches its dtype and shape (a truncated or padded file is refused).
2. Checksums: when the writer left ``checksums.json`` (``prime_rl.common.weight_checksum``), every
   tensor's CRC32 must match it and every tensor must be listed.
3. Finite values: no NaN or Inf in any floating tensor, tested on the raw bits (the exponent all
   ones) so bfloat16 needs no torch.

How it reads: every file is cut into pieces of at most 64 MiB (``PIECE_BYTES``; a tensor's pieces start
at multiples of it, so they hold whole elements), read with one ``os.preadv`` each into a buffer each
thread keeps (no allocation, no page faults per read, no Python file buffering), and the pieces of every
file are scanned by one thread pool at once: a 600 MB embedding is no longer one thread's job. Each piece
is summed with zlib's crc32 and tested for NaN/Inf in 1 MiB blocks into scratch arrays (the temporaries
stay in the CPU cache); a tensor's CRC is its pieces' CRCs merged with ``crc32_combine``. Results are
checked in file and header order, so the error raised is the first defect, as a sequential scan finds it.

Left out: verifying while the workers load (the load would have to stay paused, unlabelled and
rollback-ready until the verdict, which lives in ``weights.apply``/``control``); the scan already leaves
the files in the page cache for the load.

Measured before this layout (2 shared CPU cores, 2026-12-01, a page-cached 0.54 GB fp16 file): 3.4 GB/s
with checksums and the finite test, 4.6 GB/s checksums only, 6.7 GB/s finite test only; see
``benchmarks/results/weight_update.md`` for the figures now.
"""

from __future__ import annotations

import logging
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prime_rl.common.weight_checksum import (
    PIECE_BYTES,
    combine_piece_crcs,
    read_checksums,
    safetensors_layout,
    split_range,
)
from prime_rl.inference.weights.manifest import ITEMSIZE, SAFETENSORS_DTYPES, WeightUpdateError

logger = logging.getLogger(__name__)

# (unsigned view, exponent mask) per floating dtype: a value is NaN or Inf iff its exponent bits are all ones.
_NONFINITE = {
    "float16": (np.uint16, 0x7C00),
    "bfloat16": (np.uint16, 0x7F80),
    "float32": (np.uint32, 0x7F800000),
    "float64": (np.uint64, 0x7FF0000000000000),
}


@dataclass
class VerifyReport:
    files: int = 0
    tensors: int = 0
    bytes: int = 0
    checksummed: bool = False


SCAN_THREADS = min(8, os.cpu_count() or 1)
"""Pieces read and checked at once: zlib's crc32, file reads and numpy's bit tests release the GIL, so a 3.4 GB
model is scanned at several cores' speed (one thread: 1.5 GB/s on the H200 machine, 2.3 s for Qwen3-1.7B).
Each thread keeps a read buffer of the largest piece while the scan runs (8 threads: up to 512 MiB, freed after
it; allocated per scan, so an idle server holds none)."""
_BLOCK = 1 << 20
"""Bytes tested for NaN/Inf at once: the masked copy and the flags stay in the CPU cache."""


class _Scratch(threading.local):
    """One thread's read buffer and the finite test's temporaries, reused for every piece it scans."""

    def __init__(self, size: int) -> None:
        # np.empty, not bytearray: no memset pass over the buffer before the first read fills it
        self.buffer = memoryview(np.empty(size, np.uint8)).cast("B")
        self.masked = np.empty(_BLOCK, np.uint8)
        self.flags = np.empty(_BLOCK // 2, np.bool_)


@dataclass
class _Piece:
    """Bytes [begin, end) of tensor ``name``'s data in ``file`` (offsets within the data section)."""

    name: str
    file: Path
    fd: int
    start: int
    begin: int
    end: int
    dtype: str


def _read_piece(piece: _Piece, buffer: memoryview) -> memoryview:
    view = buffer[: piece.end - piece.begin]
    done = 0
    while done < len(view):
        n = os.preadv(piece.fd, [view[done:]], piece.start + piece.begin + done)
        if n == 0:
            raise WeightUpdateError(
                f"{piece.file} ends {len(view) - done} bytes early while tensor {piece.name} was read (truncated "
                "after the size check: is a writer still copying it?); publish the step again"
            )
        done += n
    return view


def _num_nonfinite(data: memoryview, dtype: str, scratch: _Scratch) -> int:
    view, mask = _NONFINITE[dtype]
    bits = np.frombuffer(data, dtype=view)
    per_block = _BLOCK // bits.itemsize
    masked_all = scratch.masked.view(view)
    bad = 0
    for i in range(0, len(bits), per_block):
        block = bits[i : i + per_block]
        masked, flags = masked_all[: len(block)], scratch.flags[: len(block)]
        np.bitwise_and(block, view(mask), out=masked)
        np.equal(masked, view(mask), out=flags)
        bad += int(np.count_nonzero(flags))
    return bad


def _scan_piece(piece: _Piece, crc_wanted: bool, check_finite: bool, scratch: _Scratch) -> tuple[int, int]:
    """(crc32 of the piece's stored bytes or 0, its number of NaN/Inf values)."""
    if piece.end == piece.begin:
        return 0, 0
    data = _read_piece(piece, scratch.buffer)
    crc = zlib.crc32(data) if crc_wanted else 0
    bad = _num_nonfinite(data, piece.dtype, scratch) if check_finite and piece.dtype in _NONFINITE else 0
    return crc, bad


def _check_sizes(file: Path) -> tuple[int, list[tuple[str, dict]]]:
    """(data start, [(name, info)] in header order) of a file whose header and size agree; else raises."""
    try:
        start, header = safetensors_layout(file)
    except (ValueError, UnicodeDecodeError) as e:
        raise WeightUpdateError(str(e)) from e  # names the file and the check that failed
    tensors = [(name, info) for name, info in header.items() if name != "__metadata__"]
    data_end = 0
    for name, info in tensors:
        dtype = SAFETENSORS_DTYPES.get(info["dtype"], "")
        begin, end = info["data_offsets"]
        expected = int(np.prod(info["shape"], dtype=np.int64)) * ITEMSIZE.get(dtype, 0)
        if end - begin != expected:
            raise WeightUpdateError(
                f"{file}: tensor {name} spans {end - begin} bytes but {info['dtype']}{info['shape']} needs "
                f"{expected}; the file is corrupt, publish the step again"
            )
        data_end = max(data_end, end)
    size = file.stat().st_size
    if size != start + data_end:
        raise WeightUpdateError(
            f"{file} is {size} bytes but its header describes {start + data_end}: the file is "
            f"{'truncated' if size < start + data_end else 'padded'} (a killed copy or a full disk?); "
            "the server keeps the previous weights, publish the step again"
        )
    return start, tensors


def verify_weights_dir(path: str | os.PathLike[str], check_finite: bool = True) -> VerifyReport:
    """Raise ``WeightUpdateError`` (value, rule, fix) unless every tensor's data is whole and sound."""
    path = Path(path)
    try:
        checksums = read_checksums(path)
    except (ValueError, KeyError) as e:
        raise WeightUpdateError(f"{path}/checksums.json is unreadable: {e}; the trainer rewrites it on publish") from e
    report = VerifyReport(checksummed=checksums is not None)
    files = sorted(path.glob("*.safetensors"))
    # 1. headers and sizes, in file order; the scan covers the files before the first bad one, so the error
    #    raised below is the one a file-by-file check meets first
    layouts: list[tuple[int, list[tuple[str, dict]]]] = []
    size_error: WeightUpdateError | None = None
    for file in files:
        try:
            layouts.append(_check_sizes(file))
        except WeightUpdateError as e:
            size_error = e
            break
    fds = [os.open(file, os.O_RDONLY) for file in files[: len(layouts)]]
    try:
        # 2. every piece of every file, on one pool
        pieces = [
            _Piece(name, file, fd, start, a, b, SAFETENSORS_DTYPES.get(info["dtype"], ""))
            for file, fd, (start, tensors) in zip(files, fds, layouts, strict=False)
            for name, info in tensors
            for a, b in split_range(*info["data_offsets"], PIECE_BYTES)
        ]
        crc_wanted = checksums is not None
        scratch = _Scratch(max((p.end - p.begin for p in pieces), default=0))  # a small model: small buffers
        if crc_wanted or check_finite:
            with ThreadPoolExecutor(max_workers=SCAN_THREADS) as pool:
                scanned = list(pool.map(lambda piece: _scan_piece(piece, crc_wanted, check_finite, scratch), pieces))
        else:
            scanned = [(0, 0)] * len(pieces)
    finally:
        for fd in fds:
            os.close(fd)
    # 3. verdicts in file and header order
    per_tensor: dict[tuple[Path, str], list[tuple[int, int, int]]] = {}
    for piece, (crc, bad) in zip(pieces, scanned, strict=True):
        per_tensor.setdefault((piece.file, piece.name), []).append((crc, piece.end - piece.begin, bad))
    seen: set[str] = set()
    for file, (_, tensors) in zip(files, layouts, strict=False):
        for name, info in tensors:
            results = per_tensor[(file, name)]
            if bad := sum(r[2] for r in results):
                raise WeightUpdateError(
                    f"{file}: tensor {name} has {bad} NaN/Inf value(s); refusing to serve non-finite weights "
                    "(the trainer diverged: lower the learning rate or resume from an earlier checkpoint)"
                )
            if checksums is not None:
                if name not in checksums:
                    raise WeightUpdateError(f"{path}/checksums.json lists no checksum for tensor {name}")
                crc = combine_piece_crcs([(r[0], r[1]) for r in results])
                if checksums[name] != crc:
                    raise WeightUpdateError(
                        f"{file}: tensor {name} has crc32 {crc:#010x} but checksums.json says {checksums[name]:#010x}; "
                        "the data changed after the trainer wrote it; publish the step again"
                    )
            begin, end = info["data_offsets"]
            seen.add(name)
            report.tensors += 1
            report.bytes += end - begin
        report.files += 1
    if size_error is not None:
        raise size_error
    if checksums is not None and (extra := checksums.keys() - seen):
        raise WeightUpdateError(f"{path}/checksums.json lists tensors no file holds: {sorted(extra)[:5]}")
    return report
