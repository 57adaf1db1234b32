"""The training loop shared by `sft` and the RL trainer: a batch source and an objective are what differ.

Per step s (0-based), one iteration:
1) take this rank's micro-batches for s from the source (SFT: built on the CPU during step s-1;
   RL: the orchestrator's batch, or fake rows),
2) forward + backward through the objective, which keeps every statistic on the device,
3) clip, optimizer step (optimizer-state offload overlapping backward and the next step), LR step,
4) one host sync for all statistics, then publish the weights as version s + 1 (RL; the publisher
   copies them and writes in the background), log metrics.jsonl at step s + 1, checkpoint when due.

Why this order: nothing waits on the host between the first forward and the optimizer step, so the
CPU queues the clip and the optimizer while the GPU still runs backward; the only sync is the one
that reads the step's statistics. `time/step` is that compute (forward to optimizer step, device
work included); `time/wall` is one whole iteration (waiting for data, publishing, logging,
checkpointing included): the number that says how fast a run really goes.

Profiling the real path: `PRIME_RL_PROFILE_DIR=/tmp/prof` (and optionally `PRIME_RL_PROFILE_STEPS=4,5`,
1-based, default the 4th and 5th) records those steps with the torch profiler on rank 0 and writes
`trace.json` (Chrome / Perfetto), `ops.txt` (the op table by self time) and `kernels.json` (device time per
kernel name, the steps' wall time) there; `benchmarks/trainer_profile.py compare DIR...` sets two runs'
`kernels.json` side by side.

Step convention: metrics, checkpoints (`checkpoints/step_<n>`) and published weights
(`broadcasts/step_<n>`, policy version n) all carry n = s + 1, the number of optimizer steps done.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from prime_rl.common.config.monitor import MonitorConfig
from prime_rl.common.env import PROFILE_DIR_ENV, PROFILE_STEPS_ENV
from prime_rl.common.heartbeat import Heartbeat
from prime_rl.common.monitor import build_monitor
from prime_rl.common.rundir import RunDir
from prime_rl.trainer.ckpt import CheckpointManager
from prime_rl.trainer.colocate import StepOffload
from prime_rl.trainer.model import CausalLM
from prime_rl.trainer.optim.setup import Optimization
from prime_rl.trainer.parallel import ParallelDims
from prime_rl.trainer.perf import StepTimer, perf_metrics
from prime_rl.trainer.world import World

Stats = dict[str, torch.Tensor | float | int]
"""A step's statistics: device tensors (scalars) until the loop's one host sync, or plain numbers."""


class BatchSource(Protocol):
    def get(self, step: int) -> Sequence[Any]:
        """This rank's micro-batches for step ``step`` (0-based)."""
        ...

    def close(self) -> None: ...


class Objective(Protocol):
    def forward_backward(self, model: CausalLM, micro_batches: Sequence[Any], before_last: Callable[[], None]) -> Stats:
        """Forward + backward over the micro-batches with no host sync; ``before_last()`` is called
        before the last micro-batch's forward (the optimizer-state prefetch rides on its backward)."""
        ...

    def metrics(self, stats: dict[str, float]) -> dict[str, float]:
        """metrics.jsonl entries from the host copy of the statistics ("tokens" is read by the loop)."""
        ...

    def summary(self, metrics: dict[str, float]) -> str:
        """The objective's part of the per-step log line."""
        ...


class Publisher(Protocol):
    def publish(self, version: int) -> float:
        """Make the current weights policy version ``version``; returns the seconds the loop was blocked."""
        ...

    def close(self) -> None: ...


@dataclass
class Trainer:
    """What a loop needs besides data and loss: the parallel model, its optimizer and where to write."""

    model: CausalLM
    dims: ParallelDims
    world: World
    optim: Optimization
    run_dir: RunDir
    logger: logging.Logger
    flops_per_token: float
    keep_last: int | None = None
    monitor: MonitorConfig | None = None
    """Metrics sinks besides metrics.jsonl (`[monitor.wandb]`)."""
    run_config: dict[str, Any] | None = None
    """The resolved config, logged by the monitors that keep one (W&B)."""


def to_host(stats: Stats) -> dict[str, float]:
    """All device scalars in one transfer (one sync), plain numbers as they are."""
    tensors = {k: v for k, v in stats.items() if isinstance(v, torch.Tensor)}
    out = {k: float(v) for k, v in stats.items() if not isinstance(v, torch.Tensor)}
    if tensors:
        values = torch.stack([v.detach().reshape(()).double() for v in tensors.values()]).tolist()
        out.update(zip(tensors, values, strict=True))
    return out


class StepProfiler:
    """The torch profiler over a few chosen steps of the real loop (rank 0), if PRIME_RL_PROFILE_DIR is set."""

    def __init__(self, is_main: bool):
        out = os.environ.get(PROFILE_DIR_ENV)
        self.out = out if out and is_main else None
        self.steps = [int(s) for s in os.environ.get(PROFILE_STEPS_ENV, "4,5").split(",")]
        self.prof: torch.profiler.profile | None = None
        self.started = 0.0

    def before(self, done: int) -> None:
        if self.out and done == self.steps[0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
            self.started = time.perf_counter()

    def after(self, done: int) -> None:
        if self.prof is not None and done == self.steps[-1]:
            wall = time.perf_counter() - self.started
            self.prof.__exit__(None, None, None)
            os.makedirs(self.out, exist_ok=True)
            self.prof.export_chrome_trace(os.path.join(self.out, "trace.json"))
            table = self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            with open(os.path.join(self.out, "ops.txt"), "w") as f:
                f.write(table)
            with open(os.path.join(self.out, "kernels.json"), "w") as f:
                json.dump(kernel_times(self.prof, wall, self.steps[-1] - self.steps[0] + 1), f)
            self.prof = None


def kernel_times(prof: torch.profiler.profile, wall_s: float, steps: int) -> dict[str, Any]:
    """Device time per kernel name over the profiled ``steps`` ({name: {"us", "calls"}}, all streams, so copies
    on a side stream count beside the compute they overlap), with the steps' wall time: what a step spends on the
    device against how long it takes, comparable between two runs of the same shape (`sft` and the RL trainer)."""
    kernels: dict[str, dict[str, float]] = {}
    for ev in prof.events():
        # device-side user annotations (FSDP::..., Optimizer.step#...) span kernels that are counted already
        if ev.device_type != torch.autograd.DeviceType.CUDA or getattr(ev, "is_user_annotation", False):
            continue
        k = kernels.setdefault(ev.name, {"us": 0.0, "calls": 0})
        k["us"] += ev.time_range.elapsed_us()
        k["calls"] += 1
    return {"steps": steps, "wall_s": wall_s, "kernels": kernels}


def resume(trainer: Trainer, ckpt: CheckpointManager, resume_step: int | str | None) -> int:
    """Load the checkpoint ``resume_step`` names (None: a fresh start); returns the first step to train."""
    run_dir = trainer.run_dir
    start = run_dir.resolve_resume_step(resume_step, run_dir.checkpoint_components()) or 0
    if start:
        trainer.optim.load_checkpoint(ckpt, start, trainer.model)
        trainer.logger.info(f"resumed from {trainer.run_dir.trainer_checkpoint_dir(start)}")
    return start


def train_loop(
    trainer: Trainer,
    source: BatchSource,
    objective: Objective,
    *,
    max_steps: int,
    max_norm: float | None,
    ckpt_interval: int | None,
    resume_step: int | str | None = None,
    publisher: Publisher | None = None,
    step_offload: StepOffload | None = None,
) -> int:
    """Train steps ``start..max_steps-1``; returns the number of steps done (``max_steps``)."""
    model, world, optim, logger = trainer.model, trainer.world, trainer.optim, trainer.logger
    ckpt = CheckpointManager(trainer.run_dir, trainer.keep_last, world.is_main)
    start = resume(trainer, ckpt, resume_step)
    if start and publisher is not None:  # the resumed weights are the version the orchestrator waits for
        publisher.publish(start)
    monitor = build_monitor(trainer.run_dir, trainer.monitor, "trainer", trainer.run_config) if world.is_main else None
    timer = StepTimer(world.device)
    logger.info(f"training steps {start + 1}..{max_steps} on {world.world_size} rank(s) ({trainer.dims})")
    profiler = StepProfiler(world.is_main)
    heartbeat = Heartbeat.from_env("trainer", world.rank)  # the launcher's watchdog names a stuck rank
    last_end = time.perf_counter()
    try:
        for step in range(start, max_steps):
            profiler.before(step + 1)
            heartbeat.beat("step", step + 1)  # waiting for data, computing, publishing, checkpointing
            micro_batches = source.get(step)
            if step_offload is not None:  # colocated: the batch means inference sleeps; the GPU is ours
                step_offload.at_batch()
            data_wait = time.perf_counter() - last_end
            t0 = time.perf_counter()
            optim.begin_step()  # the last step's optimizer-state offload must be done: its memory is needed
            offload_wait = time.perf_counter() - t0
            # what stays resident between steps (weights, gradients' buffers, optimizer state unless offloaded)
            resident = torch.cuda.memory_allocated(world.device) / 2**30 if world.device.type == "cuda" else None
            timer.start()
            stats = objective.forward_backward(model, micro_batches, optim.offload.arm)
            stats["optim/grad_norm"] = optim.grad_norm(max_norm)
            lr = optim.scheduler.get_last_lr()[0]
            optim.step()
            if step + 1 < max_steps and hasattr(source, "prefetch"):
                source.prefetch(step + 1)  # CPU work for the next step while the GPU finishes this one
            host = to_host(stats)
            step_time = timer.stop()
            done = step + 1
            metrics = {
                **objective.metrics(host),
                "optim/grad_norm": host["optim/grad_norm"],
                "optim/lr": lr,
                **perf_metrics(int(host["tokens"]), step_time, world.world_size, trainer.flops_per_token, world.device),
                "time/data_wait": data_wait,
                "time/offload_wait": offload_wait,
            }
            if resident is not None:
                metrics["perf/resident_memory"] = resident
            if publisher is not None:
                metrics["time/publish_weights"] = publisher.publish(done)
                write_time = getattr(publisher, "last_write_time", None)
                if write_time is not None:  # the background part of the last completed version
                    metrics["time/publish_write"] = write_time
                if hasattr(publisher, "skipped"):  # versions the disk could not keep up with
                    metrics["weights/skipped"] = publisher.skipped
                for phase, seconds in getattr(publisher, "last_phases", {}).items():  # the ipc push's parts
                    metrics[f"time/publish/{phase}"] = seconds
            if ckpt_interval and (done % ckpt_interval == 0 or done == max_steps):
                path = optim.save_checkpoint(ckpt, done, model)
                logger.info(f"saved checkpoint {path}")
            if step_offload is not None:  # colocated: hand the GPU back before inference wakes
                metrics.update(step_offload.release())
            now = time.perf_counter()
            metrics["time/wall"] = now - last_end
            last_end = now
            profiler.after(done)
            if monitor is not None:
                monitor.log(done, metrics)
            logger.info(
                f"Step {done} | {objective.summary(metrics)} | Grad norm {metrics['optim/grad_norm']:.3f} | "
                f"LR {lr:.2e} | Throughput {metrics['perf/throughput']:,.0f} tokens/s | MFU {metrics['perf/mfu']:.1%} | "
                f"Peak Mem. {metrics['perf/peak_memory']:.2f} GiB | Step time {step_time:.2f}s"
            )
    finally:
        with contextlib.suppress(Exception):
            profiler.after(profiler.steps[-1])
        if monitor is not None:
            monitor.close()
    return max_steps
