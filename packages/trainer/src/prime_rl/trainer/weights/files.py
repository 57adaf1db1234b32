"""Weight files for the filesystem transport: safetensors written straight from memory, published atomically.

- ``write_safetensors`` writes the safetensors format (8-byte little-endian header length, JSON header
  padded with spaces to a multiple of 8, raw little-endian tensor bytes) directly from the tensors'
  memory: no per-tensor ``bytes`` copy, so publishing from a host buffer costs no second host copy.
  Tensors are ordered and the header laid out as ``safetensors.torch.save_file`` does for tensors of
  one dtype, so the files are byte-identical to what it writes (tests/ check it).
- The CRC32 of every tensor (``checksums.json``) is summed from the same bytes as they are written: each
  thread writes its 64 MiB piece in 4 MiB blocks and sums each block right after ``pwrite`` copied it (the
  block is still in the CPU cache, so memory is read once), and the pieces' CRCs are merged per tensor
  with ``crc32_combine``. Before, one thread summed a whole tensor (a 600 MB embedding held one core)
  in a second pass over memory next to the writes.
- ``write_hf_dir`` writes the shards side by side, and ``checksums.json`` (per-tensor CRC32 summed from memory, ``prime_rl.common.weight_checksum``; the
  inference server checks an update against it before touching the engine) and shards through ``prime_rl.trainer.models.weights.write_shards``, as ``save_hf_weights`` does (same file names, index,
  side files). The weight files are not fsynced: a broadcast lives until inference loads it, a killed
  writer never publishes (the rename below is the publication) and readers on this host or a shared file
  system see the data once it is closed; only a machine crash could leave a renamed but torn file, which
  the checksums refuse. fsync cost 4 of the 4.4 s a Qwen3-1.7B update took to write on an H200 machine's
  disk (measured here: 1 GiB 0.65-3.6 s with fsync, 0.24-0.27 s without).
- ``publish_dir`` makes a fully written temporary directory visible under its final name with one
  ``rename`` (atomic on POSIX file systems), then fsyncs the parent: a reader sees either no ``step_<n>``
  or a complete one, never a partial one, even if the writer is killed.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from prime_rl.common.weight_checksum import combine_piece_crcs, write_checksums
from prime_rl.common.weight_layout import SAFETENSORS_DTYPES
from prime_rl.trainer.models.config import ArchConfig
from prime_rl.trainer.models.weights import write_shards, write_side_files

_PIECE = 64 * 2**20
"""Bytes per parallel write."""
_BLOCK = 4 * 2**20
"""Bytes written then summed at once: small enough to be still in the CPU cache for the sum."""
_WORKERS = min(8, os.cpu_count() or 1)
_MIN_SHARD = 256 * 2**20

TMP_SUFFIX = ".tmp"
"""A directory still being written: ``step_<n>.tmp`` (never matched by ``RunDir.broadcast_steps``)."""

_SAFETENSORS_CODES = {getattr(torch, name): code for code, name in SAFETENSORS_DTYPES.items()}
"""torch dtype -> safetensors dtype code (``prime_rl.common.weight_layout.SAFETENSORS_DTYPES``, the codes inference
reads)."""


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (CPU, contiguous)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"can only write contiguous CPU tensors, got {tensor.device} contiguous={tensor.is_contiguous()}"
        )
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def write_safetensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None, workers: int = 0
) -> dict[str, int]:
    """Write ``tensors`` to ``path`` in the safetensors format, from their memory (not fsynced: see above).
    Returns each tensor's CRC32, computed from the same memory while the bytes are written (``checksums.json``
    then needs no second read of the files, and it vouches for what the trainer meant to write). ``workers``:
    threads (0: ``_WORKERS``)."""
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) > 1:
        raise ValueError(f"write_safetensors writes one dtype per file, got {sorted(map(str, dtypes))}")
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    order = sorted(tensors)
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _SAFETENSORS_CODES:
            raise ValueError(f"tensor {name} has dtype {t.dtype}, which safetensors cannot store")
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    start = 8 + len(raw)
    views = {name: _bytes_of(tensors[name]) for name in order}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite_all(fd, memoryview(len(raw).to_bytes(8, "little") + raw), 0)
        # One thread copying 3.4 GB into the page cache took 1.5-2.1 s on the H200 machine; os.pwrite and
        # zlib.crc32 release the GIL, so pieces are written and summed on several cores at once.
        pieces = [
            (name, view[i : i + _PIECE], start + header[name]["data_offsets"][0] + i)
            for name, view in views.items()
            for i in range(0, len(view), _PIECE) or [0]  # an empty tensor: one empty piece, crc 0
        ]
        with ThreadPoolExecutor(max_workers=workers or _WORKERS) as pool:
            piece_crcs = list(pool.map(lambda piece: _write_and_sum(fd, *piece[1:]), pieces))
    finally:
        os.close(fd)
    per_tensor: dict[str, list[tuple[int, int]]] = {name: [] for name in order}
    for (name, data, _), crc in zip(pieces, piece_crcs, strict=True):
        per_tensor[name].append((crc, len(data)))
    return {name: combine_piece_crcs(crcs) for name, crcs in per_tensor.items()}


def _write_and_sum(fd: int, data: memoryview, offset: int) -> int:
    """Write ``data`` at ``offset``; its CRC32, summed block by block right after each block's write."""
    crc = 0
    for i in range(0, len(data), _BLOCK):
        block = data[i : i + _BLOCK]
        _pwrite_all(fd, block, offset + i)
        crc = zlib.crc32(block, crc)
    return crc


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_hf_dir(
    hf_state: Mapping[str, torch.Tensor], out_dir: Path, config: ArchConfig, max_shard_bytes: int | None = None
) -> None:
    """HF-named tensors as (sharded) safetensors plus config.json, tokenizer files and checksums.json.
    ``max_shard_bytes`` None: about one shard per writer thread, none below ``_MIN_SHARD`` (a small model
    stays one ``model.safetensors``): writes to one file serialize on its inode lock, so the shards are
    written side by side."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if max_shard_bytes is None:
        total = sum(t.numel() * t.element_size() for t in hf_state.values())
        max_shard_bytes = max(_MIN_SHARD, -(-total // _WORKERS))
    files: list[tuple] = []
    write_shards(hf_state, out_dir, max_shard_bytes, write=lambda *args: files.append(args))
    workers = max(1, _WORKERS // len(files))
    crcs: dict[str, int] = {}
    with ThreadPoolExecutor(max_workers=len(files)) as pool:
        for file_crcs in pool.map(lambda args: write_safetensors(*args, workers=workers), files):
            crcs.update(file_crcs)
    write_side_files(config, out_dir)
    write_checksums(out_dir, crcs)  # per-tensor CRC32s: inference verifies an update against them before loading it


def tmp_dir_of(final: Path) -> Path:
    return final.with_name(final.name + TMP_SUFFIX)


def publish_dir(tmp: Path, final: Path) -> None:
    """Atomically make the complete directory ``tmp`` visible as ``final`` (replacing an older one)."""
    _fsync_dir(tmp)
    if final.exists():  # re-publishing a version (e.g. after a resume): the old copy goes first
        stale = final.with_name(final.name + ".old")
        shutil.rmtree(stale, ignore_errors=True)
        os.rename(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.rename(tmp, final)
    _fsync_dir(final.parent)


def remove_partial_dirs(parent: Path) -> list[Path]:
    """Delete ``*.tmp`` / ``*.old`` directories a killed writer left behind; returns what it removed."""
    if not parent.is_dir():
        return []
    removed = [p for p in parent.iterdir() if p.is_dir() and p.name.endswith((TMP_SUFFIX, ".old"))]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed
