"""Page-locked (pinned) host buffers of exactly the size asked for: ``pinned_empty``.

Why: torch's pinned allocator (``torch.empty(..., pin_memory=True)``, ``Tensor.pin_memory()``) rounds every
allocation up to the next power of two and page-locks all of it (`CachingHostAllocator`; the threshold that
turns the rounding off is newer than torch 2.11). A 600 MiB bucket of optimizer state then holds 1 GiB of RAM,
a 2.5 GB embedding moment 4 GiB. On one H200 machine with 128 GiB of RAM the optimizer offload of a Qwen3-8B
shape (61 GiB of AdamW state in 512 MiB+ buckets) asked for ~108 GiB that way, and the host's OOM killer ended
the trainer in its first step (2026-12-05, `benchmarks/results/colocated.md`).

How: the buffer is an anonymous mapping of its own (``mmap``, whole pages), page-locked where it lies with
``cudaHostRegister``, as torch itself does under ``pinned_use_cuda_host_register`` (after rounding), with a
logged fallback to torch's allocator if the driver refuses. ``Tensor.is_pinned()`` is true for
it, and non-blocking copies to and from it are asynchronous. It is unregistered when the returned tensor is
garbage-collected; the memory is freed only after that (the finalizer holds the storage), so a registered range
is never returned to the OS. A view does not keep its base's Python object alive: one that outlives it reads
pageable memory (still correct, only synchronous copies), so callers keep the returned tensor as long as its
views. The long-lived buffers that use it (optimizer offload, full offload masters, rollback copies, weight
staging) do.

Short-lived buffers that are allocated and freed every step (activation offloading) keep torch's caching
allocator: its reuse is what makes them cheap, and its rounding costs them little.
"""

from __future__ import annotations

import logging
import math
import mmap
import weakref

import torch

logger = logging.getLogger(__name__)
PAGE = mmap.PAGESIZE
_PORTABLE = 1
"""``cudaHostRegisterPortable``: pinned for every CUDA context of the process, as torch's own pinned memory is."""


def _register(ptr: int, nbytes: int) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE))


def _unregister(ptr: int) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))


def _release(ptr: int, storage: torch.UntypedStorage) -> None:
    """Unpin ``ptr``; ``storage`` (the buffer's memory) is released only after, when this frame drops it."""
    _unregister(ptr)
    del storage


def pinned_empty(shape: int | tuple[int, ...], dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
    """An uninitialised host tensor of ``shape``, page-locked when ``pin`` (and CUDA is there).

    The data's pages are locked, never the power of two above. They are a mapping of their own (anonymous
    ``mmap``, page-aligned, the data rounded up to whole pages): ``cudaHostRegister`` refuses a range that
    overlaps one already registered, and the CPU allocator packs small and mid-sized buffers (below glibc's mmap
    threshold, up to 32 MiB) side by side on shared pages. ``pin=False`` or no CUDA: a plain pageable tensor
    (callers pass ``pin=buffer.is_cuda``: pinning only speeds up device copies)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if not pin or nbytes == 0 or not torch.cuda.is_available():
        return torch.empty(shape, dtype=dtype)
    length = math.ceil(nbytes / PAGE) * PAGE
    # the tensor holds the mapping (torch.frombuffer keeps its buffer object alive); unmapped with the storage
    t = torch.frombuffer(mmap.mmap(-1, length), dtype=torch.uint8)[:nbytes].view(dtype).view(shape)
    try:
        _register(t.data_ptr(), length)
    except RuntimeError as e:  # a driver that refuses to register host memory: torch's allocator still pins
        logger.warning("pinned_empty: cudaHostRegister of %d bytes failed (%s); using torch's pinned allocator, "
                       "which rounds up to a power of two", length, e)  # fmt: skip
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    # not at interpreter exit: the process's end releases the memory, and CUDA may be gone by then
    weakref.finalize(t, _release, t.data_ptr(), t.untyped_storage()).atexit = False
    return t
