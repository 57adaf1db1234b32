"""What every weight publisher shares: the background job, the tensors to publish, the announcement, pruning.

Its own module so that the transports' publishers (``publish``: filesystem and nccl, ``publish_nixl``,
``publish_lora``) import it, not each other: ``publish.build_publisher`` picks one of them, and the nixl and
LoRA ones are imported only when chosen (nixl needs its extra).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from prime_rl.common.rundir import RunDir
from prime_rl.common.weight_transports import TRANSPORTS
from prime_rl.trainer.model import CausalLM
from prime_rl.trainer.weights.announce import VersionAnnouncer
from prime_rl.trainer.weights.staging import model_state
from prime_rl.trainer.world import World

logger = logging.getLogger(__name__)


class Closeable(Protocol):
    def close(self) -> None: ...


class BackgroundJob:
    """At most one background task at a time; its exception is raised by the next ``wait``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, fn: Callable[[], None]) -> None:
        assert self._thread is None, "wait() for the previous job first"

        def run() -> None:
            try:
                fn()
            except BaseException as e:  # re-raised in the training loop by wait()
                logger.error("%s failed: %s: %s", self.name, type(e).__name__, e)
                self._error = e

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> float:
        """Join the job in flight (if any); returns the seconds waited; raises the job's error."""
        start = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"{self.name} failed: {type(error).__name__}: {error}") from error
        return time.perf_counter() - start


def require_inference_addresses(cfg) -> None:
    """Rank 0 of a transport whose loading the trainer drives (``Transport.loads``) must know every server."""
    if TRANSPORTS[cfg.type].loads == "trainer" and not cfg.inference_addresses:
        raise ValueError(
            f"weight_broadcast.type={cfg.type!r} needs weight_broadcast.inference_addresses (the inference "
            "servers' control endpoints, tcp://host:port)"
        )


def publish_state(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model tensors to publish (model names; a tied LM head is the embedding and is not sent twice)."""
    state = model_state(model)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


class Publisher:
    """Shared bookkeeping: the background job, its timings and the announcer (rank 0)."""

    def __init__(self, cfg, model: CausalLM, world: World, job_name: str) -> None:
        self.cfg, self.model, self.world = cfg, model, world
        self.dtype: torch.dtype = getattr(torch, cfg.dtype)
        self.job = BackgroundJob(job_name)
        self.announcer = VersionAnnouncer(cfg.announce, timeout_s=cfg.announce_timeout) if world.is_main else None
        # the parameters are updated in place, so their state dict (names -> possibly sharded tensors)
        # is built once: walking the module tree every step costs tens of milliseconds of host time
        self.state = publish_state(model)
        self.last_write_time = 0.0
        """Seconds the background part of the last completed version took."""
        self.last_wait_time = 0.0
        """Seconds the last ``publish`` waited for the previous version's background part (backpressure)."""

    def flush(self) -> None:
        """Wait until the version in flight is complete (written / served) and announced."""
        self.last_wait_time = self.job.wait()

    def _announce(self, version: int, path: str | None, blocked: float) -> None:
        if self.announcer is not None:
            self.announcer.announce(version, path=path, publish_s=blocked, write_s=self.last_write_time)

    def _serve_then_announce(self, version: int, blocked: float, wait_served: Callable[[int], None]) -> None:
        """Background part of a push transport (nccl, nixl): wait until every server serves ``version``
        (``wait_served``, the sender's ``finish``), then announce it."""
        start = time.perf_counter()
        wait_served(version)
        self.last_write_time = time.perf_counter() - start
        self._announce(version, None, blocked)

    def close(self) -> None:
        """Flush, then release sockets. Call on every rank at exit."""
        try:
            self.flush()
        finally:
            if self.announcer is not None:
                self.announcer.close()


class PushPublisher(Publisher):
    """A push transport's publisher (nccl, nixl, ipc): its ``sender`` moves the bytes into the inference servers
    and is closed after the last version is served (None on ranks that only join the all-gathers). Rank 0
    refuses a config without the inference servers' control addresses (``require_inference_addresses``)."""

    sender: Closeable | None = None

    def __init__(self, cfg, model: CausalLM, world: World, job_name: str) -> None:
        super().__init__(cfg, model, world, job_name)
        if world.is_main:  # rank 0 sends the control requests, so it alone needs the addresses
            require_inference_addresses(cfg)

    def sender_options(self) -> dict[str, Any]:
        """What every push sender takes from the shared push config (``_PushConfig``), under the sender's keyword
        names (the config's ``timeout`` is ``timeout_s``); a transport passes its own settings beside these."""
        return {"timeout_s": self.cfg.timeout, "keep_rollback_copy": self.cfg.keep_rollback_copy}

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.sender is not None:
                self.sender.close()


def prune_versions(run_dir: RunDir, version: int, keep_last: int) -> None:
    """Keep the newest ``keep_last`` filesystem versions up to ``version``; versions above it belong to a run
    this one resumed from an earlier checkpoint and must never be served. ``version`` itself (the newest
    complete one) is always kept, and a directory being written is never listed."""
    steps = run_dir.broadcast_steps()
    older = [s for s in steps if s <= version]
    stale = [s for s in steps if s > version] + older[:-keep_last]
    for step in stale:
        shutil.rmtree(run_dir.broadcast_dir(step), ignore_errors=True)
