"""Activation offloading: tensors autograd saves for backward go to CPU during forward and come back
when backward unpacks them (`torch.autograd.graph.saved_tensors_hooks`).

On CUDA the device->host copies run on a side stream into pinned memory, so forward keeps computing
while they drain; at most `max_inflight_activations` copies are in flight (forward waits on the oldest
before starting another), which bounds the GPU memory still held by tensors on their way out. Small GPU
tensors (< 1 MiB: norms' statistics, index tensors) and parameters stay where they are: copying them
costs more than it frees. On a CPU device "offloading" is a copy of every saved tensor into separate
host storage: the same pack/unpack path runs (it is what the CPU tests exercise), though it saves nothing.

Tensors retained by a selective-AC policy are held by the checkpoint itself and stay on the device;
with full AC only the non-checkpointed parts (embedding, final norm, LM head, skipped blocks) and the
block inputs routed through autograd are offloaded.
"""

from collections import deque
from collections.abc import Callable

import torch
from torch import nn

MIN_OFFLOAD_BYTES = 1 << 20


class ActivationOffloader:
    """Holds the side stream and in-flight copies; `hooks()` returns the context for one forward."""

    def __init__(self, max_inflight: int, min_bytes: int = MIN_OFFLOAD_BYTES):
        self.max_inflight = max_inflight
        self.min_bytes = min_bytes
        self.inflight: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()
        self.stream: torch.cuda.Stream | None = None
        self.num_offloaded = 0
        """Tensors offloaded since construction (tests and logs read it)."""

    def _pack(self, t: torch.Tensor):  # noqa: ANN202 - a tensor or a (device, tensor) pair
        if isinstance(t, nn.Parameter) or t.is_sparse:
            return t
        if t.device.type != "cuda":  # CPU: exercise the path with a real copy into new storage
            self.num_offloaded += 1
            return t.device, t.detach().clone()
        if t.numel() * t.element_size() < self.min_bytes:
            return t
        self.num_offloaded += 1
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        while len(self.inflight) >= self.max_inflight:
            event, _ = self.inflight.popleft()
            event.synchronize()  # the GPU tensor it held may now be freed
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.inflight.append((event, t))  # keeps t alive until the copy is done
        return t.device, host, event

    def _unpack(self, packed):  # noqa: ANN001, ANN202
        if isinstance(packed, torch.Tensor):
            return packed
        if len(packed) == 2:
            return packed[1]
        device, host, event = packed
        event.synchronize()
        return host.to(device, non_blocking=True)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def drain(self) -> None:
        """Forget finished copies at the end of forward (their GPU tensors are then only held by autograd)."""
        while self.inflight:
            event, _ = self.inflight.popleft()
            event.synchronize()


def apply_ac_offloading(root: nn.Module, max_inflight: int) -> ActivationOffloader:
    """Run `root`'s forward under the offloading hooks (instance-level forward, names unchanged)."""
    offloader = ActivationOffloader(max_inflight)
    forward: Callable = root.forward

    def offloaded_forward(*args, **kwargs):  # noqa: ANN202
        with offloader.hooks():
            out = forward(*args, **kwargs)
        offloader.drain()
        return out

    root.forward = offloaded_forward
    root.activation_offloader = offloader
    return offloader
