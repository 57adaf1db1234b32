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
  that happens between the write and the load (a full disk, a killed copy, a bad NFS page).
- Pure Python + numpy-free: importable by the torch-free packages.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHECKSUMS_FILE = "checksums.json"
ALGORITHM = "crc32"
_CHUNK = 16 << 20


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
    jobs = []
    for file in sorted(Path(directory).glob("*.safetensors")):
        start, header = safetensors_layout(file)
        jobs += [(name, file, start, *info["data_offsets"]) for name, info in header.items() if name != "__metadata__"]
    # zlib's crc32 and file reads release the GIL: tensors are summed on several cores at once
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        crcs = pool.map(lambda job: tensor_crc(*job[1:]), jobs)
        return {job[0]: crc for job, crc in zip(jobs, crcs, strict=True)}


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
