"""Publish the policy after each step so inference can serve it, without holding the training loop.

Interface (what the training loop calls): ``publisher = build_publisher(cfg, run_dir, model, world)``,
``publisher.publish(version) -> float`` on every rank after each optimizer step (returns the seconds
the loop was blocked), ``publisher.flush()`` to wait for the version in flight (e.g. before a
checkpoint or an evaluation that must see it served), ``publisher.close()`` at exit (flushes).
``publisher.last_write_time`` / ``last_wait_time`` are the background part of the previous version
and how long ``publish`` waited for it (backpressure); log them next to the blocked time.

Who owns what. The trainer owns every version: it is the only component that decides a version
exists, moves it, and announces it, once complete, to the orchestrator as a ``WeightsPublished``
message over ZeroMQ (``prime_rl.trainer.weights.announce``; no marker file is a notification).
The orchestrator owns staleness: it tags rollouts with the newest announced version that inference
serves and waits for announcements to honour ``max_off_policy_steps``. The one asymmetry is who makes
inference load: with nccl/nixl the trainer pushes (the sender must take part in the transfer) and
announces a version inference already serves; with the filesystem transport the announcement carries
the directory and the orchestrator pauses inference, has it load the files and reopens its request
gate with the new version, because closing that gate around the load is what keeps its version tags
exact (a trainer-driven load could only be learned about after the fact). The announcement is sent
only after the version is whole (renamed into place / served), so ``max_off_policy_steps = 0`` keeps
its meaning: the orchestrator never tags, and so never trains on, a version older than allowed.

What overlaps the next step, per transport:

- filesystem: the loop pays for the all-gathers (collective, every rank, one parameter at a time) and
  the cast to the publish dtype on the device; the device-to-host copy runs on a side CUDA stream into
  a reusable pinned buffer, and a writer thread writes ``broadcasts/step_<n>.tmp/``, fsyncs it,
  writes the ``STABLE`` marker last, renames it to ``step_<n>/`` (atomic), announces it, then prunes
  old versions (off the update's critical path). The loop never waits for the disk: when the writer is
  still busy, the next version goes to a second buffer, and a staged version the writer has not started
  is replaced by a newer one (never announced; ``skipped`` counts them). A trainer killed mid-write
  leaves only ``step_<n>.tmp`` (removed at the next start), never a loadable partial ``step_<n>``.
  Host memory: one copy of the weights in the publish dtype, pinned, on rank 0, and a second one once
  the disk falls behind the steps (``weights.staging``); no further copy is made to write it
  (``weights.files``).
- nccl: gather + cast on the device, bucket packing and the broadcast itself stay in ``publish`` (the
  sender must take part; GPU-to-GPU it is ~10 ms for 3.5 GB); waiting for every server to reload the
  weights (``AwaitWeightsRequest``, the slow part) and the announcement move to the background thread.
- nixl: every rank gathers + casts on the device and stages its slices until the receivers have read
  every group (the slots hold one or two groups, so the source must stay until the last read);
  the wait for the engines' reload and the announcement move to the background thread. Letting the
  receivers read while the next step computes would need a complete extra copy to read from; left out.

The ``STABLE`` marker stays inside each filesystem version because the inference server refuses a
directory without it (``check_checkpoint_dir``): it is part of what makes a version loadable, not a
notification; the rename is what makes it visible atomically.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from typing import TYPE_CHECKING

from prime_rl.common.config.rl_trainer import FilesystemBroadcastConfig, NCCLBroadcastConfig, NixlBroadcastConfig
from prime_rl.common.rundir import BROADCAST_MARKER, RunDir
from prime_rl.trainer.model import CausalLM
from prime_rl.trainer.models import model_state_dict_to_hf
from prime_rl.trainer.models.config import load_arch_config
from prime_rl.trainer.rl.publish_base import Publisher, PushPublisher, prune_versions
from prime_rl.trainer.weights.files import publish_dir, remove_partial_dirs, tmp_dir_of, write_hf_dir
from prime_rl.trainer.weights.staging import HostStaging, gather_full_tensors
from prime_rl.trainer.world import World

if TYPE_CHECKING:
    from prime_rl.trainer.rl.publish_nixl import NixlPublisher

logger = logging.getLogger(__name__)


class FilesystemPublisher(Publisher):
    """Safetensors under ``broadcasts/step_<n>/``, written in the background and published atomically.

    The training loop never waits for the disk: a writer thread writes the newest staged version while
    the loop goes on. Two host buffers alternate (the second is allocated only the first time a version
    arrives while the previous one is still being written); when the writer falls behind, a staged
    version it has not started is replaced by the newer one and never announced (counted in
    ``skipped``). So inference always gets the newest complete weights as fast as the disk allows, and
    the loop pays only for the gather, the cast and queuing the device-to-host copy.
    ``max_off_policy_steps`` still holds: the orchestrator waits for an announced version >= the one it
    needs, and the newest staged version is always written.
    """

    def __init__(self, cfg: FilesystemBroadcastConfig, run_dir: RunDir, model: CausalLM, world: World):
        super().__init__(cfg, model, world, "weight writer")
        self.run_dir = run_dir
        self.buffers: list[HostStaging] = [HostStaging(world.device)] if world.is_main else []
        self.skipped = 0
        """Versions replaced by a newer one before the writer started them (never written or announced)."""
        self._cv = threading.Condition()
        self._pending: tuple[int, HostStaging, float] | None = None  # staged, not yet claimed by the writer
        self._writing: HostStaging | None = None
        self._error: BaseException | None = None
        self._closing = False
        self._writer: threading.Thread | None = None
        if world.is_main:
            for path in remove_partial_dirs(run_dir.broadcasts_dir):
                logger.warning("removed %s, a weight version a previous trainer did not finish writing", path)
            self._writer = threading.Thread(target=self._write_loop, name="weight writer", daemon=True)
            self._writer.start()

    def publish(self, version: int) -> float:
        """Collective. Returns the seconds the caller was blocked; the write continues in the background."""
        start = time.perf_counter()
        self._raise_writer_error()
        state = self.state
        tensors = gather_full_tensors(state, self.dtype, keep=self.world.is_main, cast_on_cpu=False)
        if not self.world.is_main:
            for _ in tensors:  # join every all-gather
                pass
            return time.perf_counter() - start
        with self._cv:  # a buffer neither being written nor holding a staged version; else the staged one
            staged = self._pending[1] if self._pending is not None else None
            free = [b for b in self.buffers if b is not self._writing and b is not staged]
            if not free and len(self.buffers) < 2:
                self.buffers.append(HostStaging(self.world.device))
                free = self.buffers[-1:]
            staging = free[0] if free else staged
            if self._pending is not None:  # the writer has not started it: the newer version replaces it
                logger.info("weight version %d skipped: the writer is still on an older one", self._pending[0])
                self._pending = None
                self.skipped += 1
        staging.capture(state, tensors, self.dtype)
        blocked = time.perf_counter() - start
        with self._cv:
            self._pending = (version, staging, blocked)
            self._cv.notify_all()
        return blocked

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending is not None or self._closing)
                if self._pending is None:
                    return
                (version, staging, blocked), self._pending = self._pending, None
                self._writing = staging
            try:
                self._write(version, staging, blocked)
            except BaseException as e:  # re-raised in the training loop by the next publish / flush
                logger.error("weight writer failed on version %d: %s: %s", version, type(e).__name__, e)
                with self._cv:
                    self._error = e
            finally:
                with self._cv:
                    self._writing = None
                    self._cv.notify_all()

    def _raise_writer_error(self) -> None:
        with self._cv:
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"weight writer failed: {type(error).__name__}: {error}") from error

    def flush(self) -> None:
        """Wait until the newest staged version is written and announced."""
        start = time.perf_counter()
        with self._cv:
            self._cv.wait_for(lambda: self._pending is None and self._writing is None)
        self.last_wait_time = time.perf_counter() - start
        self._raise_writer_error()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            with self._cv:
                self._closing = True
                self._cv.notify_all()
            if self._writer is not None:
                self._writer.join()
            if self.announcer is not None:
                self.announcer.close()

    def _write(self, version: int, staging: HostStaging, blocked: float) -> None:
        start = time.perf_counter()
        staging.wait()
        final = self.run_dir.broadcast_dir(version)
        tmp = tmp_dir_of(final)
        shutil.rmtree(tmp, ignore_errors=True)
        config = load_arch_config(self.model.config)
        write_hf_dir(model_state_dict_to_hf(staging.tensors(), config), tmp, config)
        (tmp / BROADCAST_MARKER).touch()
        publish_dir(tmp, final)
        self.last_write_time = time.perf_counter() - start
        self._announce(version, str(final), blocked)
        # After the announcement: removing old versions took 0.22-0.26 s on the H200 machine, and inference
        # needs only the version just announced (never pruned: it is the newest one kept).
        prune_versions(self.run_dir, version, self.cfg.keep_last)


class BroadcastPublisher(PushPublisher):
    """nccl (gloo on CPU): rank 0 broadcasts into the inference workers; the reload wait is in the background."""

    def __init__(self, cfg: NCCLBroadcastConfig, run_dir: RunDir, model: CausalLM, world: World):
        super().__init__(cfg, model, world, "weight broadcast")
        self.run_dir = run_dir
        self.sender = None
        if world.is_main:
            from prime_rl.trainer.weights.broadcast_sender import WeightBroadcaster

            backend = "nccl" if world.device.type == "cuda" else "gloo"
            self.sender = WeightBroadcaster(
                cfg.inference_addresses,
                host=cfg.host,
                port=cfg.port,
                backend=backend,
                **self.sender_options(),
            )
            self.sender.connect()

    def publish(self, version: int) -> float:
        start = time.perf_counter()
        self.flush()  # the previous version is served (and announced) before the next one is sent
        state = self.state
        tensors = gather_full_tensors(state, self.dtype, keep=self.sender is not None)
        sender = self.sender
        if sender is None:
            for _ in tensors:
                pass
            return time.perf_counter() - start
        hf = model_state_dict_to_hf(dict(tensors), self.model.config)
        named = [(name, t.contiguous()) for name, t in hf.items()]
        sender.stage(version, named)
        del named, hf
        blocked = time.perf_counter() - start
        self.job.start(lambda: self._serve_then_announce(version, blocked, sender.finish))
        return blocked


def build_publisher(
    cfg: FilesystemBroadcastConfig | NCCLBroadcastConfig | NixlBroadcastConfig,
    run_dir: RunDir,
    model: CausalLM,
    world: World,
) -> FilesystemPublisher | BroadcastPublisher | NixlPublisher:
    """The publisher for ``[weight_broadcast]``: filesystem, nccl (gloo on CPU) or nixl."""
    if cfg.type == "nixl":
        from prime_rl.trainer.rl.publish_nixl import NixlPublisher  # needs the nixl extra

        return NixlPublisher(cfg, run_dir, model, world)
    if isinstance(cfg, NCCLBroadcastConfig):
        return BroadcastPublisher(cfg, run_dir, model, world)
    if getattr(model.model, "lora_config", None) is not None:  # LoRA: the adapter alone, in peft format
        from prime_rl.trainer.rl.publish_lora import build_lora_publisher

        return build_lora_publisher(cfg, run_dir, model, world)
    return FilesystemPublisher(cfg, run_dir, model, world)
