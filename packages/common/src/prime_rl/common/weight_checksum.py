"""Per-tensor checksums of a published weights directory, written by the trainer, checked by inference.

``checksums.json`` beside the safetensors files: ``{"algorithm": "crc32", "tensors": {name: crc}}``
where ``crc`` is ``zlib.crc32`` of the tensor's bytes exactly as stored in its safetensors file. The
trainer writes it before the directory's marker (``write_checksums(dir)``); inference checks every
tensor against it before the engine is touched (``prime_rl.inference.weights.verify``).

Design decisions:
- CRC32, not a cryptographic hash: it guards against truncated, torn or bit-rotted files. Forged
  files are the control plane's business (``prime_rl.common.auth``), not the checksum's. zlib's crc32
  runs at memory-ish speed on one core and needs no dependency.
- Checksums are taken from the files: a one-line hook in any writer, and it still catches everything
  that happens between the write and the load (a full disk, a killed copy, a bad NFS page). The
  trainer's writer sums the bytes it writes as it writes them (``prime_rl.trainer.weights.files``).
- One tensor is summed in pieces on several threads (zlib's crc32 releases the GIL) and the pieces'
  CRCs are merged with ``crc32_combine``: zlib's GF(2) matrix method, in Python because the
  standard library does not expose it. The operators for 2^k zero bytes are built once, so a merge is
  one 32x32 bit-matrix product per set bit of the length (microseconds), not zlib's squarings per call.
  A 600 MB embedding then no longer holds one core while the others wait.
- Pure Python + numpy-free: importable by the torch-free packages.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHECKSUMS_FILE = "checksums.json"
ALGORITHM = "crc32"
_CHUNK = 16 << 20
PIECE_BYTES = 64 << 20
"""Bytes summed (and read, by the verifier) per job: large enough that a job's overhead is noise, small
enough that a 3.4 GB model spreads over every thread."""
_POLY = 0xEDB88320  # CRC-32 (IEEE 802.3) polynomial, bit-reversed: zlib's


def _gf2_times(mat: Sequence[int], vec: int) -> int:
    """Product of a 32x32 GF(2) matrix (one int per column) and a 32-bit vector."""
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: Sequence[int]) -> list[int]:
    return [_gf2_times(mat, col) for col in mat]


def _zero_byte_operators() -> list[list[int]]:
    """``ops[k]`` advances a CRC register over 2^k zero bytes (k < 64), as zlib's crc32_combine builds them."""
    one_bit = [_POLY] + [1 << n for n in range(31)]  # the register shifted by one zero bit
    op = _gf2_square(_gf2_square(_gf2_square(one_bit)))  # 2, 4, then 8 bits: one zero byte
    ops = [op]
    for _ in range(63):
        op = _gf2_square(op)
        ops.append(op)
    return ops


_ZERO_BYTE_OPS: list[list[int]] = []


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc1 = zlib.crc32(a)``, ``crc2 = zlib.crc32(b)`` and ``len2 = len(b)``."""
    if len2 < 0:
        raise ValueError(f"len2={len2} must be >= 0 (the byte length of the second block)")
    if not _ZERO_BYTE_OPS:  # built on first use (~30 ms); a race only builds the same list twice
        _ZERO_BYTE_OPS[:] = _zero_byte_operators()
    k = 0
    while len2:  # crc1 shifted over len2 zero bytes, then xor crc2 (CRC is linear over GF(2))
        if len2 & 1:
            crc1 = _gf2_times(_ZERO_BYTE_OPS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def combine_piece_crcs(pieces: Sequence[tuple[int, int]]) -> int:
    """CRC32 of consecutive pieces given as (crc32 of the piece, its byte length), in order."""
    crc = 0
    for piece_crc, length in pieces:
        crc = crc32_combine(crc, piece_crc, length)
    return crc


def split_range(begin: int, end: int, piece: int | None = None) -> list[tuple[int, int]]:
    """[begin, end) as consecutive [a, b) of at most ``piece`` (default ``PIECE_BYTES``) bytes; one empty
    piece for an empty range."""
    piece = piece or PIECE_BYTES
    return [(a, min(a + piece, end)) for a in range(begin, end, piece)] or [(begin, end)]


def safetensors_layout(file: Path) -> tuple[int, dict[str, dict]]:
    """(start of the data section, header) of a safetensors file; ``ValueError`` if it is not one."""
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file} is not a safetensors file (shorter than 8 bytes)")
        (header_len,) = struct.unpack("<Q", raw)
        size = os.fstat(f.fileno()).st_size
        if header_len > size - 8:  # random bytes read as a length: read(huge) raised OverflowError
            raise ValueError(
                f"{file} is not a safetensors file: its first 8 bytes give a header of {header_len} bytes, "
                f"but only {size - 8} follow (check: header length <= file size - 8)"
            )
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file} has a corrupt safetensors header (check: the header is UTF-8 JSON): {e}") from e
    if not isinstance(header, dict) or not all(
        isinstance(v, dict) and {"dtype", "shape", "data_offsets"} <= v.keys()
        for k, v in header.items()
        if k != "__metadata__"
    ):
        raise ValueError(
            f"{file} has a corrupt safetensors header (check: a JSON object of tensors with dtype, shape and "
            "data_offsets)"
        )
    return 8 + header_len, header


def iter_tensor_bytes(file: Path, start: int, begin: int, end: int, chunk: int = _CHUNK) -> Iterator[bytes]:
    """The stored bytes of one tensor (``data_offsets`` [begin, end)) in chunks."""
    with open(file, "rb") as f:
        f.seek(start + begin)
        remaining = end - begin
        while remaining > 0:
            piece = f.read(min(chunk, remaining))
            if not piece:
                raise ValueError(f"{file} ends {remaining} bytes early (truncated)")
            remaining -= len(piece)
            yield piece


def tensor_crc(file: Path, start: int, begin: int, end: int) -> int:
    crc = 0
    for piece in iter_tensor_bytes(file, start, begin, end):
        crc = zlib.crc32(piece, crc)
    return crc


def compute_checksums(directory: str | os.PathLike[str]) -> dict[str, int]:
    """``{tensor name: crc32}`` over every ``*.safetensors`` file in ``directory``."""
    jobs = []  # (name, file, start, begin, end) per piece of at most PIECE_BYTES
    for file in sorted(Path(directory).glob("*.safetensors")):
        start, header = safetensors_layout(file)
        for name, info in header.items():
            if name != "__metadata__":
                jobs += [(name, file, start, a, b) for a, b in split_range(*info["data_offsets"])]
    # zlib's crc32 and file reads release the GIL: pieces (of one tensor too) are summed on several cores at once
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        crcs = list(pool.map(lambda job: tensor_crc(*job[1:]), jobs))
    pieces: dict[str, list[tuple[int, int]]] = {}
    for (name, _, _, a, b), crc in zip(jobs, crcs, strict=True):
        pieces.setdefault(name, []).append((crc, b - a))
    return {name: combine_piece_crcs(p) for name, p in pieces.items()}


def write_checksums(directory: str | os.PathLike[str], crcs: dict[str, int] | None = None) -> Path:
    """Write ``checksums.json`` for the safetensors files in ``directory`` (call before the marker): ``crcs``
    when the writer summed the tensors from memory as it wrote them, else read back from the files."""
    path = Path(directory) / CHECKSUMS_FILE
    tmp = path.with_suffix(".tmp")
    crcs = compute_checksums(directory) if crcs is None else crcs
    tmp.write_text(json.dumps({"algorithm": ALGORITHM, "tensors": crcs}))
    os.replace(tmp, path)
    return path


def read_checksums(directory: str | os.PathLike[str]) -> dict[str, int] | None:
    """The checksums written for ``directory``, or None when the writer wrote none."""
    path = Path(directory) / CHECKSUMS_FILE
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if data.get("algorithm") != ALGORITHM:
        raise ValueError(f"{path}: algorithm {data.get('algorithm')!r} is not {ALGORITHM!r}")
    return {name: int(crc) for name, crc in data["tensors"].items()}
