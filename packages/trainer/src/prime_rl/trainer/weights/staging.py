"""Gather the full policy, cast it on the device and copy it into a reusable host buffer, off the compute stream.

``gather_full_tensors`` is the collective part: every rank walks the model's state dict in the same
order and all-gathers one parameter at a time (``DTensor.full_tensor``), so at most one full
parameter (plus the D2H copies still in flight, bounded below) is materialized on the device at once;
the cast to the publish dtype happens on the device, before any byte crosses PCIe.

``HostStaging`` (rank 0) owns one flat host buffer, pinned on CUDA, sized once for the whole state
dict in the publish dtype and reused by every publish. Its ``capture`` enqueues each cast tensor's
copy on a side CUDA stream (``non_blocking``) and returns; ``wait`` blocks until the copies are done.
So the training loop pays for the all-gathers and the cast kernels, not for the transfer, and the
next step's compute overlaps it. On CPU the copy is synchronous and ``wait`` returns at once.

Host memory: one copy of the published weights in the publish dtype (a 1.7B model in bf16: 3.4 GB
pinned), on the main rank only. Device memory: at most ``max_in_flight_bytes`` of cast tensors waiting
for their copy (4 GiB by default: a whole 1.7B model in bf16, so the loop never waits for PCIe at that
size; they are freed as their copies land, ~54 GB/s on an H200), beyond one full parameter.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from prime_rl.common.weight_sync.pinned import pinned_empty

ALIGN = 64
"""Byte alignment of every tensor inside the host buffer."""


@dataclass(frozen=True)
class Entry:
    """Where one model tensor lives in the host buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    num_bytes: int


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict in model names (``model.`` prefix removed), values possibly sharded DTensors."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    return {k.removeprefix("model."): v for k, v in sd.items()}


def gather_full_tensors(
    state: dict[str, torch.Tensor], dtype: torch.dtype, keep: bool, cast_on_cpu: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective (every rank iterates it fully, in the same order): each tensor unsharded and cast to
    ``dtype`` on its device. Ranks with ``keep=False`` still join every all-gather but yield nothing.

    On an accelerator the yielded tensor never aliases a parameter (``copy=True``), so a copy of it still
    in flight cannot see the optimizer's next in-place update. ``cast_on_cpu=False`` yields CPU tensors
    uncast (the caller's synchronous ``copy_`` into a ``dtype`` buffer casts in the same pass)."""
    for name, value in state.items():
        if isinstance(value, DTensor):  # a one-rank mesh holds the whole tensor: skip the collective machinery
            full = value.to_local() if value.device_mesh.size() == 1 else value.full_tensor()
        else:
            full = value
        if keep:
            if full.device.type == "cpu" and not cast_on_cpu:
                yield name, full.detach()
            else:
                yield name, full.detach().to(dtype, copy=True)


class HostStaging:
    """A reusable (pinned on CUDA) host copy of the published state dict; see the module docstring."""

    def __init__(self, device: torch.device, max_in_flight_bytes: int = 4 << 30) -> None:
        self.device = device
        self.max_in_flight_bytes = max_in_flight_bytes
        self.buffer: torch.Tensor | None = None
        self.entries: list[Entry] = []
        self.dtype: torch.dtype | None = None
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._done: torch.cuda.Event | None = None

    @property
    def num_bytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def _plan(self, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        entries, offset = [], 0
        for name, value in state.items():
            shape = tuple(value.shape)  # a DTensor's shape is the global one
            num_bytes = value.numel() * dtype.itemsize
            entries.append(Entry(name, shape, offset, num_bytes))
            offset = _align(offset + num_bytes)
        if self.entries != entries or self.dtype != dtype:
            self.entries, self.dtype = entries, dtype
            self.buffer = pinned_empty(max(offset, 1), torch.uint8, pin=self._cuda)  # not rounded up

    def capture(
        self, state: dict[str, torch.Tensor], tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype
    ) -> None:
        """Copy every yielded tensor into the buffer (asynchronously on CUDA). The previous capture must
        be consumed (``wait`` + its reader done): the buffer is overwritten in place.

        On CUDA the copies go out in chunks of up to ``max_in_flight_bytes``: the chunk's cast tensors
        are queued on the compute stream, the side stream waits for them once and copies the whole
        chunk (one wait and one event per chunk, not per tensor: ~300 tensors cost milliseconds of
        host time otherwise); the host waits only when an older chunk is still in flight beyond that."""
        self._plan(state, dtype)
        assert self.buffer is not None
        by_name = {e.name: e for e in self.entries}
        in_flight: deque[torch.cuda.Event] = deque()
        chunk: list[tuple[torch.Tensor, torch.Tensor]] = []
        chunk_bytes = 0

        def flush_chunk() -> None:
            assert self._stream is not None
            if in_flight:  # bound the device memory held by cast copies to about two chunks
                in_flight.popleft().synchronize()
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for target, tensor in chunk:
                    target.copy_(tensor, non_blocking=True)
                    tensor.record_stream(self._stream)  # its memory is not reused before the copy has read it
                in_flight.append(self._stream.record_event())

        for name, tensor in tensors:
            entry = by_name[name]
            target = self.buffer[entry.offset : entry.offset + entry.num_bytes].view(dtype).view(entry.shape)
            if not self._cuda:
                target.copy_(tensor)  # casts if ``tensor`` is not in ``dtype`` yet (one pass over the bytes)
                continue
            chunk.append((target, tensor))
            chunk_bytes += entry.num_bytes
            if chunk_bytes >= self.max_in_flight_bytes:
                flush_chunk()
                chunk, chunk_bytes = [], 0
        if self._cuda:
            if chunk:
                flush_chunk()
            assert self._stream is not None
            self._done = self._stream.record_event()

    def wait(self) -> None:
        """Block until the last capture's copies have landed in the buffer (any thread may call it)."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Views of the buffer, in model names and shapes (valid until the next ``capture``)."""
        assert self.buffer is not None and self.dtype is not None
        return {
            e.name: self.buffer[e.offset : e.offset + e.num_bytes].view(self.dtype).view(e.shape) for e in self.entries
        }
