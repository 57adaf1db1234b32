"""The trainer's side of a colocated run (`[deployment] type = "colocated"`, `offload_between_steps`): between
steps, give the GPU back to the inference server that shares it, and record the memory of each phase.

When to touch the GPU: only once a batch has arrived. The orchestrator puts inference to sleep before it
sends the batch (`prime_rl.orchestrator.colocate.HandOver`), so the batch is the signal; the trainer waits
for batches anyway, and no other channel is needed.

What moves, per step (after the optimizer step, the publish and any checkpoint, before the next batch):
- optimizer state: AdamW's moments go to pinned host memory after each `optimizer.step()` (`model.offload =
  "optimizer"`, which `rl` sets for colocated runs; `prime_rl.trainer.optim.offload`). `release` waits for
  that copy to finish, so the device buffers are really free before inference wakes;
- gradients: freed by `zero_grad(set_to_none=True)`;
- the caching allocator's free blocks: returned to the driver (`torch.cuda.empty_cache`). Without this the
  memory freed above stays reserved by this process and vLLM cannot wake its KV cache into it.
What stays: the fp32 master weights (sharded by FSDP) and the CUDA context; the launcher sizes vLLM's share
around them (`prime_rl.launcher.colocate`).

Memory timeline: allocated and reserved GiB at each phase boundary go into the step's metrics
(`memory/<phase>_allocated`, `memory/<phase>_reserved`): `at_batch` (what the trainer held while inference
ran), `peak` (the step's peak), `before_release`, `released`. `time/release` is the seconds `release` took.

With the ipc transport inference wakes its weights during the publish, before ``release``: the publisher
calls ``make_room`` (the same frees) on every rank first (``prime_rl.trainer.rl.publish_ipc``).

Left out: moving the master weights themselves between steps (`model.offload = "full"` keeps them on the host
for the whole run instead), and the trainer's start-up, which runs while inference is awake.
"""

from __future__ import annotations

import atexit
import gc
import time
from collections.abc import Callable

import torch

from prime_rl.trainer.optim.offload import OptimizerOffload

GiB = 2**30

MemoryReader = Callable[[], tuple[int, int, int]]
"""() -> (allocated, reserved, peak allocated since the last reset) bytes on this rank's device."""


def cuda_memory(device: torch.device) -> MemoryReader:
    def read() -> tuple[int, int, int]:
        return (
            torch.cuda.memory_allocated(device),
            torch.cuda.memory_reserved(device),
            torch.cuda.max_memory_allocated(device),
        )

    return read


class StepOffload:
    """Frees this rank's GPU memory between steps and records the memory of each phase."""

    def __init__(
        self,
        device: torch.device,
        optimizer_offload: OptimizerOffload | None = None,
        memory: MemoryReader | None = None,
        empty_cache: Callable[[], None] | None = None,
    ) -> None:
        self.device = device
        self.optimizer_offload = optimizer_offload
        on_gpu = device.type == "cuda"
        self.memory = memory if memory is not None else (cuda_memory(device) if on_gpu else None)
        self.empty_cache = empty_cache if empty_cache is not None else (torch.cuda.empty_cache if on_gpu else None)
        self.reset_peak: Callable[[], None] = (
            (lambda: torch.cuda.reset_peak_memory_stats(device)) if on_gpu and memory is None else (lambda: None)
        )
        self._metrics: dict[str, float] = {}
        self._frozen = False

    def at_batch(self) -> None:
        """The batch is here (inference sleeps): record what this rank held meanwhile, then start the step."""
        self._record("at_batch")
        self.reset_peak()

    def release(self) -> dict[str, float]:
        """After the step's publish and checkpoint: free what can be freed; returns the step's memory metrics."""
        start = time.perf_counter()
        self._record("before_release", peak=True)
        self.make_room()
        self._record("released")
        self._metrics["time/release"] = time.perf_counter() - start
        metrics, self._metrics = self._metrics, {}
        return metrics

    def make_room(self) -> None:
        """Free what the step left on the device: ``release`` at the step's end, and the ipc publisher before it
        wakes inference's weights (those then share the GPU with the trainer's master weights and the push)."""
        if self.optimizer_offload is not None:
            self.optimizer_offload.wait()  # the moments' copy to the host is done: their device buffers are free
        gc.collect()  # tensors of the step held only by reference cycles
        if not self._frozen:
            # A full collection walks every object the process holds: ~0.25 s with torch, inductor's graphs and
            # the model (release took 0.26-0.29 s on the H200 with nothing to free), and a colocated step runs
            # this three times, twice on the hand-over's critical path. What survived the first one (modules,
            # compiled code, the model) is frozen: later collections walk only newer objects (0.3 ms). Frozen
            # objects are still freed by reference counting; only cycles among them wait for the process's end,
            # where unfreezing lets the last collection free them (nanobind reports leaks otherwise).
            gc.freeze()
            atexit.register(gc.unfreeze)
            self._frozen = True
        if self.empty_cache is not None:
            self.empty_cache()

    def _record(self, phase: str, peak: bool = False) -> None:
        if self.memory is None:
            return
        allocated, reserved, max_allocated = self.memory()
        self._metrics[f"memory/{phase}_allocated"] = allocated / GiB
        self._metrics[f"memory/{phase}_reserved"] = reserved / GiB
        if peak:
            self._metrics["memory/peak_allocated"] = max_allocated / GiB
