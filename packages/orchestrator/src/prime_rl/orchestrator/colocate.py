"""The orchestrator's side of a colocated run (`[deployment] type = "colocated"`): inference and trainer take
turns on the same GPUs, and the orchestrator, which knows when rollouts are done, hands the GPUs over.

One step, synchronous (`max_off_policy_steps = 0`):

1. rollouts for step n (inference awake, the trainer resting: its optimizer state on the host);
2. ``HandOver.sleep``: hold the request gate (no rollout may start) and put every server to sleep
   (``SleepRequest``: vLLM frees its KV cache, and its weights at level 2 or moves them to the host at 1);
3. the batch goes to the trainer. Its arrival is the trainer's signal that the GPUs are free (no other
   channel: the trainer waits for batches anyway); it trains, publishes version n + 1 and frees its own memory;
4. filesystem: the trainer's announcement reaches the ``WeightUpdater``, which loads through this hand-over:
   pause -> wake "weights" -> load the files -> wake "kv_cache" -> resume, then the gate reopens at n + 1;
   ipc (a push transport): the trainer, its step done and its free memory returned, wakes "weights" itself
   (``WakeUpRequest`` from its publisher, through the control client it pushes with), pushes n + 1 and
   announces it once every server serves it (verified, or rolled back and refused); that announcement, the
   signal every push transport already gives, makes the updater call ``after_push``: wake "kv_cache", then
   the gate reopens at n + 1.

Waking the weights before the load gives the workers buffers to write into; the KV cache, the larger part,
is woken only once the new weights are in. A push the servers refuse is never announced: the trainer raises
the servers' reason and exits, and the launcher stops the run (inference, which serves the rolled-back
version with its KV cache asleep, goes with it: never asleep and waited on forever). Each move is timed and
lands in the step's metrics (`colocate/*`): the seconds each request took and how long inference slept.

Every request goes to every server the orchestrator controls (``ZmqInferenceControl``, all of
``orchestrator.inference.addresses``): in a colocated SLURM job that is one server per node, so every node's GPUs
are free before the batch reaches any trainer rank.

Left out: overlap (rollouts for n + 1 during training n cannot run on a sleeping engine), and restarts of a
colocated inference server (`inference.max_restarts`, whose watch holds the same gate).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Protocol

from prime_rl.common.wire import HealthReply
from prime_rl.orchestrator.policy import PolicyState
from prime_rl.orchestrator.weights import InferenceControl

logger = logging.getLogger(__name__)


class SleepControl(InferenceControl, Protocol):
    """An ``InferenceControl`` that can also put every server to sleep and wake it (``ZmqInferenceControl``)."""

    async def sleep(self, level: int) -> None: ...

    async def wake_up(self, tags: list[str]) -> None: ...


class HandOver:
    """An ``InferenceControl`` for the weight updater that wakes inference around each load, plus ``sleep``."""

    def __init__(self, control: SleepControl, policy: PolicyState, level: int) -> None:
        self.control = control
        self.policy = policy
        self.level = level
        self.asleep_since: float | None = None
        self._metrics: dict[str, float] = {}

    # -- the hand-over itself --------------------------------------------------------------------

    async def sleep(self) -> None:
        """After a step's rollouts: no request may start, then every server frees the GPUs."""
        start = time.perf_counter()
        await self.policy.hold()
        await self.control.sleep(self.level)
        now = time.perf_counter()
        self.asleep_since = now
        self._add("colocate/sleep_s", now - start)
        logger.info("inference asleep (level %d) in %.2fs: the trainer has the GPUs", self.level, now - start)

    async def load_weights(self, path: Path, version: int) -> None:
        """Wake the weights, load ``path`` into them, wake the KV cache (generation stays paused)."""
        t0 = time.perf_counter()
        await self.control.wake_up(["weights"])
        t1 = time.perf_counter()
        await self.control.load_weights(path, version)
        t2 = time.perf_counter()
        await self.control.wake_up(["kv_cache"])
        t3 = time.perf_counter()
        self._add("colocate/wake_weights_s", t1 - t0)
        self._add("colocate/load_s", t2 - t1)
        self._add("colocate/wake_kv_s", t3 - t2)
        self._awake(t3)
        logger.info(
            "inference awake with version %d: weights woken %.2fs, loaded %.2fs, KV cache woken %.2fs",
            version, t1 - t0, t2 - t1, t3 - t2,
        )  # fmt: skip

    async def after_push(self, version: int) -> None:
        """A push transport: the trainer woke the weights and every server serves ``version`` (its announcement
        says so); wake the KV cache, and rollouts may start again (the updater reopens the gate at ``version``)."""
        start = time.perf_counter()
        await self.control.wake_up(["kv_cache"])  # generation resumes in each server once all of it is awake
        now = time.perf_counter()
        self._add("colocate/wake_kv_s", now - start)
        self._awake(now)
        await self.policy.release()
        logger.info("inference awake with version %d pushed by the trainer: KV cache woken %.2fs", version, now - start)

    async def resume(self) -> None:
        await self.control.resume()
        await self.policy.release()  # rollouts may start again (the updater reopens the gate at the new version)

    def pop_metrics(self) -> dict[str, float]:
        """What moved since the last call, in seconds (summed when a step saw more than one)."""
        metrics, self._metrics = self._metrics, {}
        return metrics

    def _add(self, key: str, seconds: float) -> None:
        self._metrics[key] = self._metrics.get(key, 0.0) + seconds

    def _awake(self, now: float) -> None:
        """The KV cache is back: how long inference slept goes into the step's metrics."""
        if self.asleep_since is not None:
            self._add("colocate/asleep_s", now - self.asleep_since)
            self.asleep_since = None

    # -- the rest of InferenceControl, passed through ---------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        return self.control.endpoints

    @property
    def excluded(self) -> set[str]:
        return self.control.excluded

    async def pause(self, mode: str) -> None:
        await self.control.pause(mode)

    async def health(self) -> list[HealthReply | None]:
        return await self.control.health()

    async def restore(self, endpoint: str, path: Path | None, version: int, mode: str) -> None:
        await self.control.restore(endpoint, path, version, mode)

    def close(self) -> None:
        self.control.close()
