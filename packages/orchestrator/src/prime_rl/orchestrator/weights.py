"""Weight sync, orchestrator side: learn each new policy version from the trainer and make it the served one.

The trainer owns versions: once version ``n`` is complete it sends a ``WeightsPublished`` message to
the orchestrator's PULL socket (``trainer.weights_port``; the trainer's ``weight_broadcast.announce``).
Nothing here looks at the file system to discover versions. ``WeightUpdater`` drains announcements;
for the newest one that is newer than the served version it

- filesystem (the message names a complete ``broadcasts/step_<n>`` directory): closes the request
  gate (``PolicyState``), calls ``pause -> load_weights -> resume`` on every server through an
  ``InferenceControl``, and reopens the gate with the new version;
- nccl / nixl (no path: the trainer pushed the weights and every server already serves them): reopens
  the gate with the new version.

Either way every request started afterwards is tagged with a version inference really serves.
Requests already in flight keep the version they started with (the conservative tag: with pause mode
"keep" their tail uses newer weights). Several announcements in one poll load only the newest.

Why the orchestrator, not the trainer, drives the filesystem load: closing the gate around the load is
what keeps the tags exact, and only the orchestrator can close it; the trainer's background writer
then never waits for inference either. Push transports cannot be driven from here (the sender takes
part in the transfer), so the trainer announces them once served.

Resuming: ``recover(run_dir, max_version)`` loads the newest complete ``broadcasts/step_<n>`` with
``n <= max_version`` (``RunDir.latest_published_step``) once at start (a directory exists only when complete: the trainer renames it
into place), so a resumed run serves the weights of its resume step without waiting for the trainer.

`InferenceControl` is the seam: `ZmqInferenceControl` speaks `prime_rl.common.wire` control
messages to each server's control endpoint; tests use an in-memory fake.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from prime_rl.common.heartbeat import Heartbeat
from prime_rl.common.rundir import BROADCAST_MARKER, RunDir
from prime_rl.common.servers import ServerSet
from prime_rl.common.transport import ControlClient, PeerLostError, Receiver
from prime_rl.common.weight_transports import FILESYSTEM
from prime_rl.common.wire import (
    ControlReply,
    HealthReply,
    HealthRequest,
    Message,
    PauseRequest,
    ResumeRequest,
    SleepRequest,
    WakeUpRequest,
    WeightsPublished,
)
from prime_rl.orchestrator.policy import PolicyState

logger = logging.getLogger(__name__)


class InferenceControl(Protocol):
    """Control plane of the inference servers (all of them: each call must reach every server not ``excluded``)."""

    endpoints: list[str]
    """Every server's control address, in the order of `health`'s replies."""
    excluded: set[str]
    """Servers waited out while the others serve (heal.py): updates skip them until `restore` brings them back."""

    async def pause(self, mode: str) -> None: ...

    async def load_weights(self, path: Path, version: int) -> None: ...

    async def resume(self) -> None: ...

    async def health(self) -> list[HealthReply | None]:
        """Every server's health (None for one that does not answer in a few seconds); [] without servers."""
        ...

    async def restore(self, endpoint: str, path: Path | None, version: int, mode: str) -> None:
        """Load ``version`` (from ``path``; None: the model's own weights, nothing to load) into the one server at
        ``endpoint`` and take it back into updates."""
        ...

    def close(self) -> None: ...


class NoInferenceControl:
    """No control endpoint configured: versions are tracked, nothing is sent (inference updates itself)."""

    def __init__(self) -> None:
        self.endpoints: list[str] = []
        self.excluded: set[str] = set()

    async def pause(self, mode: str) -> None:
        pass

    async def load_weights(self, path: Path, version: int) -> None:
        pass

    async def resume(self) -> None:
        pass

    async def health(self) -> list[HealthReply | None]:
        return []

    async def restore(self, endpoint: str, path: Path | None, version: int, mode: str) -> None:
        pass

    def close(self) -> None:
        pass


class InferenceControlError(RuntimeError):
    """A server refused or failed a control request."""


class ServerRestartedError(ConnectionError):
    """A server answered an update as a new process: it restarted since its last answer, so it lacks what this update
    assumed (the weights loaded so far, a pause). Handled like a server lost mid-update (`WeightUpdater._apply`)."""


class ServerGoneError(ConnectionError):
    """A server answered a control request with an error and its health failed right after: it is going away (vLLM's
    engine core died under the request: the API server answers with EngineDeadError, then exits), so the request is
    lost to that death, not refused. Handled like a server lost mid-update (`WeightUpdater._apply`). Known here, by
    the server's own health, and not only by the HTTP route's: behind a router, the other replicas keep that healthy."""


class ZmqInferenceControl:
    """Sends PauseRequest / LoadWeightsRequest / ResumeRequest (and a colocated run's sleep / wake) to every server
    through one ``ServerSet``; tells a refusal from a server that went away (``ServerGoneError``, a lost connection,
    a restart), which the orchestrator heals."""

    HEALTH_TIMEOUT_S = 3.0

    def __init__(self, addresses: list[str], timeout: float = 600.0) -> None:
        if not addresses:
            raise ValueError("ZmqInferenceControl needs at least one control address (tcp://host:port)")
        # watch_peer: a server that dies while handling a request (a weight load) is known at once (PeerLostError),
        # not after `timeout`
        self.servers = ServerSet(addresses, timeout, watch_peer=True)
        self.endpoints = self.servers.endpoints
        self.excluded: set[str] = set()
        # sockets of their own: health is polled while a weight update may be waiting on the others (REQ sockets
        # hold one request at a time)
        self._health = ServerSet(addresses, self.HEALTH_TIMEOUT_S, watch_peer=True)
        self._health_locks = [threading.Lock() for _ in addresses]  # a socket is used by one thread at a time
        self._gone: set[str] = set()
        """Servers that went away during this update: the restarted one was never paused, so it is not resumed
        (that request would wait for its start-up)."""
        self._boot_ids: dict[str, str] = {}
        """Each address's last ``boot_id``: a restart that falls between two requests (ZeroMQ queues a request for a
        dead peer and the restarted server answers it) shows only as a new id."""

    async def _broadcast(self, message: Message, clients: list[ControlClient] | None = None) -> None:
        everyone = clients is None
        clients = [c for c in self.servers.clients if c.endpoint not in self.excluded] if everyone else clients
        # With several replicas, one known gone fails an update at once (its siblings serve on, heal.py), rather
        # than waiting in ZeroMQ's queue for its restart; one server alone is waited for (the restart answers), and
        # so is one addressed alone (`restore`: its health answered, this socket may not have reconnected yet).
        fail_fast = everyone and len(self.servers.clients) > 1
        indices = [self.servers.clients.index(c) for c in clients]
        # off the event loop (rollouts go on); every server's answer is awaited, not just the first failure
        replies = await asyncio.to_thread(self.servers.gather, message, indices, fail_fast)
        restarted = [c.endpoint for c, r in zip(clients, replies) if isinstance(r, Message) and self._new_boot(c, r)]
        failed = [(c, r) for c, r in zip(clients, replies) if not (isinstance(r, ControlReply) and r.ok)]
        dying: set[str] = set()  # answered with an error and not well afterwards (vLLM's engine died under it)
        for client, reply in failed:
            if isinstance(reply, Message) and not await self._well(client):
                dying.add(client.endpoint)
            if isinstance(reply, PeerLostError) or client.endpoint in dying:
                self._gone.add(client.endpoint)
        # a lost server first: the update is then lost to its death, which the watch heals, whatever else failed
        for client, reply in sorted(failed, key=lambda f: f[0].endpoint not in self._gone):
            if isinstance(reply, BaseException):
                raise reply
            error = getattr(reply, "error", None) or f"unexpected reply {type(reply).__name__}"
            failure = f"{type(message).__name__} failed on {client.endpoint}: {error}"
            if client.endpoint in dying:
                raise ServerGoneError(f"{failure} (and its health fails since: the server is going away)")
            raise InferenceControlError(failure)
        if restarted:
            raise ServerRestartedError(
                f"{', '.join(restarted)} answered {type(message).__name__} as a new process (its boot id changed): it "
                "restarted since its last answer and serves weights this update did not give it"
            )

    def _new_boot(self, client: ControlClient, reply: Message) -> bool:
        """Record the reply's boot id; True when it differs from the one the same address sent before."""
        boot_id = getattr(reply, "boot_id", "")
        if not boot_id:
            return False
        before = self._boot_ids.get(client.endpoint)
        self._boot_ids[client.endpoint] = boot_id
        return before is not None and before != boot_id

    async def _well(self, client: ControlClient) -> bool:
        reply = await asyncio.to_thread(self._ask_health, self.servers.clients.index(client))
        return isinstance(reply, HealthReply) and reply.ok

    def _ask_health(self, index: int) -> HealthReply | None:
        client = self._health.clients[index]
        with self._health_locks[index]:
            if client.peer_gone:  # its server went away and none answers yet: no need to wait out the timeout
                return None
            try:
                reply = client.request(HealthRequest())
            except (TimeoutError, PeerLostError):  # down, or restarting (the socket was reopened for the next try)
                return None
        return reply if isinstance(reply, HealthReply) else None

    async def pause(self, mode: str) -> None:
        self._gone.clear()  # an update begins
        try:
            await self._broadcast(PauseRequest(mode=mode, by="orchestrator"))
        except (ServerRestartedError, PeerLostError, ServerGoneError):  # the update ends: unpause what it paused
            await self.resume()  # (`WeightUpdater._apply` resumes only after a pause)
            raise

    async def load_weights(self, path: Path, version: int) -> None:
        await self._broadcast(FILESYSTEM.begin_request(version, path=str(path)))

    async def resume(self) -> None:
        skip = self._gone | self.excluded
        await self._broadcast(ResumeRequest(), [c for c in self.servers.clients if c.endpoint not in skip])

    # colocated runs (prime_rl.orchestrator.colocate.HandOver): free the GPUs for the trainer, and take them back
    async def sleep(self, level: int) -> None:
        await self._broadcast(SleepRequest(level=level, by="orchestrator"))

    async def wake_up(self, tags: list[str]) -> None:
        await self._broadcast(WakeUpRequest(tags=tags, by="orchestrator"))

    async def restore(self, endpoint: str, path: Path | None, version: int, mode: str) -> None:
        [client] = [c for c in self.servers.clients if c.endpoint == endpoint]
        if path is not None:
            await self._broadcast(PauseRequest(mode=mode, by="orchestrator"), [client])
            try:
                await self._broadcast(FILESYSTEM.begin_request(version, path=str(path)), [client])
            finally:
                await self._broadcast(ResumeRequest(), [client])
        self.excluded.discard(endpoint)

    async def health(self) -> list[HealthReply | None]:
        replies = list(
            await asyncio.gather(*(asyncio.to_thread(self._ask_health, i) for i in range(len(self._health.clients))))
        )
        for client, reply in zip(self._health.clients, replies):
            if reply is not None:  # a restart seen here is the one being waited out (heal.py): recorded, not raised
                self._new_boot(client, reply)
        return replies

    def close(self) -> None:
        self.servers.close()
        self._health.close()


class VersionListener:
    """The orchestrator's end of the trainer's announcements: a ZeroMQ PULL socket, bound on first use
    (so building an orchestrator that never runs binds nothing) and polled without blocking."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._receiver: Receiver | None = None
        self.latest: WeightsPublished | None = None
        """Newest announcement received so far."""

    def open(self) -> Receiver:
        if self._receiver is None:
            self._receiver = Receiver(self.endpoint, bind=True, types=(WeightsPublished,))
            self.endpoint = self._receiver.endpoint
        return self._receiver

    def poll(self) -> WeightsPublished | None:
        """Drain every pending announcement; return the newest one (None if none arrived since the last poll)."""
        receiver = self.open()
        newest = None
        while True:
            try:
                message = receiver.recv(timeout_s=0).message
            except TimeoutError:
                break
            if newest is None or message.version > newest.version:
                newest = message
        if newest is not None and (self.latest is None or newest.version > self.latest.version):
            self.latest = newest
        return newest

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None


class WeightUpdater:
    """Applies the trainer's announcements to inference; `wait_for_version` bounds staleness."""

    def __init__(
        self,
        listener: VersionListener,
        control: InferenceControl,
        policy: PolicyState,
        *,
        pause_mode: str = "keep",
        poll_interval: float = 0.1,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        self.listener = listener
        # The orchestrator's progress heartbeat for the launcher's watchdog (a no-op outside a launched
        # run): wait_for_version runs once per step, so its calls mark the orchestrator's step boundaries.
        self.heartbeat = heartbeat if heartbeat is not None else Heartbeat.from_env("orchestrator")
        self.control = control
        self.policy = policy
        self.pause_mode = pause_mode
        self.poll_interval = poll_interval
        self.num_updates = 0
        self.last_update_s = 0.0
        self.last_announcement: WeightsPublished | None = None
        """The newest announcement applied (the trainer's publish / background times ride along)."""
        self._lock = asyncio.Lock()  # the poller and wait_for_version must not load the same version twice
        self.before_update: Callable[[], Awaitable[None]] | None = None
        """Awaited before a version is applied (the orchestrator's InferenceWatch: inference is back), outside the
        lock, which the watch's reload takes."""
        self.inference_down: Callable[[], bool] | None = None
        """True while the watch waits for inference to come back (checked again once the lock is taken)."""
        self.on_unanswered: Callable[[str], Awaitable[None]] | None = None
        """Called when a server goes away during an update (the orchestrator's InferenceWatch.lost): its control
        request times out, its connection drops (`PeerLostError`), or it fails while ``server_gone`` says the server
        is going away; None: that error stops the run."""
        self.server_gone: Callable[[], Awaitable[bool]] | None = None
        """Asked when a server answers an update with an error: True when inference is going away (vLLM's engine
        died under the load: the reply is its death, not a refusal of the weights), so the update is lost, not
        failed. None: every error reply stops the run."""
        self.after_push: Callable[[int], Awaitable[None]] | None = None
        """Awaited with the version once a pushed one (no path) is announced, before the gate reopens at it
        (colocated runs: ``HandOver.after_push`` wakes the KV cache); its error stops the run."""
        self.failure: BaseException | None = None
        """The poller's error: a failed update stops the run, and every later call re-raises it (re-opening
        the version socket the poller closed would fail with 'Address already in use' and hide it)."""

    async def update_once(self) -> bool:
        """Apply the newest announced version if it is newer than the served one; True if it did."""
        if self.failure is not None:
            raise self.failure
        while True:
            if self.before_update is not None:
                await self.before_update()
            async with self._lock:
                if self.failure is not None:  # the poller failed while this call waited for the lock
                    raise self.failure
                if self.inference_down is not None and self.inference_down():
                    continue  # it went away while this call waited for the lock (the poller's and a step's calls)
                self.listener.poll()
                message = self.listener.latest
                if message is None or message.version <= self.policy.version:
                    return False
                return await self._apply(message)

    async def recover(self, run_dir: RunDir, max_version: int) -> bool:
        """At start-up: load the newest complete filesystem version <= ``max_version`` (a resumed run)."""
        async with self._lock:
            step = run_dir.latest_published_step(max_version)
            if step is None or step <= self.policy.version:
                return False
            return await self._apply(WeightsPublished(version=step, path=str(run_dir.broadcast_dir(step))))

    async def reload(self, broadcasts_dir: Path) -> int | None:
        """Load the served version again (a restarted server came back with its start-up weights); returns it, or
        None when it is the model's own weights (version 0: nothing to load)."""
        async with self._lock:
            version = self.policy.version
            if version == 0:
                return None
            path = self._served_path(broadcasts_dir, version)
            await self.control.pause(self.pause_mode)
            try:
                await self.control.load_weights(path, version)
            finally:
                await self.control.resume()
            logger.info("reloaded policy version %d into the restarted inference server (%s)", version, path)
            return version

    async def restore_replica(self, endpoint: str, broadcasts_dir: Path) -> int:
        """Bring one restarted server (its siblings served on) to the served version and back into updates; returns
        that version. Under the lock: an update to a newer version waits, then reaches it too."""
        async with self._lock:
            version = self.policy.version
            path = self._served_path(broadcasts_dir, version) if version else None
            await self.control.restore(endpoint, path, version, self.pause_mode)
            logger.info("restored policy version %d into the restarted inference server %s", version, endpoint)
            return version

    def _served_path(self, broadcasts_dir: Path, version: int) -> Path:
        announced = self.last_announcement
        path = announced.path if announced is not None and announced.version == version else None
        path = Path(path) if path is not None else broadcasts_dir / f"step_{version}"
        if not (path / BROADCAST_MARKER).is_file():
            raise FileNotFoundError(
                f"inference came back without policy version {version} and {path} (its weights) is gone; "
                "raise weight_broadcast.keep_last so the served version stays on disk"
            )
        return path

    async def _apply(self, message: WeightsPublished) -> bool:
        """Make ``message``'s version the served one; False when a server went away during it (see below)."""
        start = time.perf_counter()
        version = message.version
        if message.path is not None:
            await self.policy.close()
            try:
                await self.control.pause(self.pause_mode)
                try:
                    await self.control.load_weights(Path(message.path), version)
                finally:
                    await self.control.resume()
            except (TimeoutError, ConnectionError, InferenceControlError) as e:
                await self.policy.open()  # keep the old version
                if self.on_unanswered is None or not await self._lost_to_a_death(e):
                    raise
                # A server that dies mid-update (inference restarts, `inference.max_restarts`): the watch brings the
                # new one to the served version, then the next poll applies this one again. Not waited for here: the
                # watch's reload takes this lock.
                await self.on_unanswered(f"weight update to version {version} lost ({type(e).__name__}: {e})")
                return False
            except BaseException:
                await self.policy.open()  # keep the old version; the error stops the run
                raise
        elif self.after_push is not None:
            await self.after_push(version)
        await self.policy.open(version=version)
        self.num_updates += 1
        self.last_update_s = time.perf_counter() - start
        self.last_announcement = message
        where = f"loaded {message.path}" if message.path else "pushed by the trainer"
        logger.info("inference now serves policy version %d (%s, %.2fs)", version, where, self.last_update_s)
        return True

    async def _lost_to_a_death(self, error: Exception) -> bool:
        """Whether a failed update died with its server (then it is applied again once the server is back)."""
        if not isinstance(error, InferenceControlError):
            return True  # no answer, or the connection carrying the request closed
        return self.server_gone is not None and await self.server_gone()

    async def run(self) -> None:
        """Poll forever (cancelled when the orchestrator stops); closes the listener when it ends."""
        self.listener.open()
        try:
            while True:
                await self.update_once()
                await asyncio.sleep(self.poll_interval)
        except Exception as e:
            self.failure = e
            raise
        finally:
            self.listener.close()

    async def wait_for_version(self, min_version: int, timeout: float) -> None:
        """Block until inference serves `min_version` or newer, updating as announcements arrive.

        Heartbeat: "waiting for policy <min_version>" (deadline ``timeout``), then "rollouts" until the
        next call (deadline: the run's stall timeout), so a step that never ends (a hanging environment,
        rollouts that never come back) is named by the watchdog.
        """
        self.heartbeat.beat("waiting for policy", min_version, deadline_s=timeout, progress=True)
        deadline = time.monotonic() + timeout
        while self.policy.version < min_version:
            await self.update_once()
            if self.policy.version >= min_version:
                break
            if time.monotonic() > deadline:
                latest = self.listener.latest
                heard = f"the newest announced is {latest.version}" if latest else "no version was announced yet"
                raise TimeoutError(
                    f"waited {timeout:.0f}s for the trainer to announce policy version {min_version} on "
                    f"{self.listener.endpoint} ({heard}; inference serves version {self.policy.version}); is the "
                    "trainer running with weight_broadcast.announce pointing here? raise weights_timeout or "
                    "max_off_policy_steps"
                )
            await asyncio.sleep(self.poll_interval)
        self.heartbeat.beat("rollouts", min_version, progress=True)
