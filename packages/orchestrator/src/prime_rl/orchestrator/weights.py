"""Weight sync: notice the trainer's published weights and have every inference server load them.

The trainer writes `<run_dir>/broadcasts/step_<n>/` and, last, the marker file `BROADCAST_MARKER` in
it (atomic completion). `WeightUpdater` polls for the newest complete step; when it is newer than
the served version it closes the request gate (`PolicyState`), calls `pause -> load_weights ->
resume` on every server through an `InferenceControl`, and reopens the gate with the new version,
so every request started afterwards is tagged with it. Requests already in flight keep the version
they started with (the conservative tag: with pause mode "keep" their tail uses newer weights).
Several published steps in one poll load only the newest.

`InferenceControl` is the seam: `ZmqInferenceControl` speaks `prime_rl.common.wire` control
messages to each server's control endpoint; tests use an in-memory fake.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path
from typing import Protocol

from prime_rl.common.transport import ControlClient
from prime_rl.common.wire import ControlReply, LoadWeightsRequest, Message, PauseRequest, ResumeRequest
from prime_rl.orchestrator.policy import PolicyState

logger = logging.getLogger(__name__)

BROADCAST_MARKER = "STABLE"
"""File the trainer writes last into broadcasts/step_<n>/ once every weight file is complete."""

_STEP_DIR = re.compile(r"^step_(\d+)$")


class InferenceControl(Protocol):
    """Control plane of the inference servers (all of them: each call must reach every server)."""

    async def pause(self, mode: str) -> None: ...

    async def load_weights(self, path: Path, version: int) -> None: ...

    async def resume(self) -> None: ...

    def close(self) -> None: ...


class NoInferenceControl:
    """No control endpoint configured: versions are tracked, nothing is sent (inference updates itself)."""

    async def pause(self, mode: str) -> None:
        pass

    async def load_weights(self, path: Path, version: int) -> None:
        pass

    async def resume(self) -> None:
        pass

    def close(self) -> None:
        pass


class InferenceControlError(RuntimeError):
    """A server refused or failed a control request."""


class ZmqInferenceControl:
    """Sends PauseRequest / LoadWeightsRequest / ResumeRequest to every server, in parallel threads."""

    def __init__(self, addresses: list[str], timeout: float = 600.0) -> None:
        if not addresses:
            raise ValueError("ZmqInferenceControl needs at least one control address (tcp://host:port)")
        self._clients = [ControlClient(address, timeout_s=timeout) for address in addresses]

    async def _broadcast(self, message: Message) -> None:
        # ZeroMQ REQ sockets are blocking: one thread per server keeps the event loop (and rollouts) moving.
        replies = await asyncio.gather(*(asyncio.to_thread(c.request, message) for c in self._clients))
        for client, reply in zip(self._clients, replies):
            if not isinstance(reply, ControlReply) or not reply.ok:
                error = getattr(reply, "error", None) or f"unexpected reply {type(reply).__name__}"
                raise InferenceControlError(f"{type(message).__name__} failed on {client.endpoint}: {error}")

    async def pause(self, mode: str) -> None:
        await self._broadcast(PauseRequest(mode=mode))

    async def load_weights(self, path: Path, version: int) -> None:
        await self._broadcast(LoadWeightsRequest(path=str(path), version=version))

    async def resume(self) -> None:
        await self._broadcast(ResumeRequest())

    def close(self) -> None:
        for client in self._clients:
            client.close()


def latest_published_step(broadcasts_dir: Path) -> int | None:
    """Newest step_<n> under broadcasts/ whose marker exists (None if there is none)."""
    if not broadcasts_dir.is_dir():
        return None
    steps = [
        int(m.group(1))
        for p in broadcasts_dir.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / BROADCAST_MARKER).is_file()
    ]
    return max(steps, default=None)


class WeightUpdater:
    """Polls broadcasts/ and loads newer weights into inference; `wait_for_version` bounds staleness."""

    def __init__(
        self,
        broadcasts_dir: Path,
        control: InferenceControl,
        policy: PolicyState,
        *,
        pause_mode: str = "keep",
        poll_interval: float = 0.1,
    ) -> None:
        self.broadcasts_dir = broadcasts_dir
        self.control = control
        self.policy = policy
        self.pause_mode = pause_mode
        self.poll_interval = poll_interval
        self.num_updates = 0
        self.last_update_s = 0.0
        self._lock = asyncio.Lock()  # the poller and wait_for_version must not load the same step twice

    async def update_once(self) -> bool:
        """Load the newest published weights if they are newer than the served version; True if it did."""
        async with self._lock:
            step = latest_published_step(self.broadcasts_dir)
            if step is None or step <= self.policy.version:
                return False
            await self._load(step)
            return True

    async def _load(self, step: int) -> None:
        path = self.broadcasts_dir / f"step_{step}"
        start = time.perf_counter()
        await self.policy.close()
        try:
            await self.control.pause(self.pause_mode)
            try:
                await self.control.load_weights(path, step)
            finally:
                await self.control.resume()
        except BaseException:
            await self.policy.open()  # keep the old version; the error stops the run
            raise
        await self.policy.open(version=step)
        self.num_updates += 1
        self.last_update_s = time.perf_counter() - start
        logger.info("inference now serves policy version %d (loaded %s in %.2fs)", step, path, self.last_update_s)

    async def run(self) -> None:
        """Poll forever (cancelled when the orchestrator stops)."""
        while True:
            await self.update_once()
            await asyncio.sleep(self.poll_interval)

    async def wait_for_version(self, min_version: int, timeout: float) -> None:
        """Block until inference serves `min_version` or newer, updating as weights appear."""
        deadline = time.monotonic() + timeout
        while self.policy.version < min_version:
            await self.update_once()
            if self.policy.version >= min_version:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"waited {timeout:.0f}s for the trainer to publish {self.broadcasts_dir}/step_{min_version}/"
                    f"{BROADCAST_MARKER} (inference serves version {self.policy.version}); is the trainer running "
                    "with this run_dir? raise weights_timeout or max_off_policy_steps"
                )
            await asyncio.sleep(self.poll_interval)
