"""Waiting out an inference restart: hold rollouts, see the server back, reload the policy, send again.

`rl` restarts a dead inference server (`inference.max_restarts`, the launcher's supervisor). The restarted
server serves the model's own weights (version 0), not the policy the orchestrator tags rollouts with, so:

1. The first request that fails because the server went away (connection refused or dropped, a 502/503/504,
   a timeout) calls ``InferenceWatch.lost``: the policy gate is held (`PolicyState.hold`), so no request starts
   on a server whose weights are unknown; the orchestrator's heartbeat says "waiting for inference" with the
   outage deadline (a waiting phase: the watchdog does not blame the orchestrator for the outage).
2. A recovery task polls the HTTP health route and every server's control plane until all answer (at most
   ``outage_timeout`` seconds, `orchestrator.inference.outage_timeout`, which `rl` derives from the server's
   start-up deadline); a server reporting another weight version than the served one gets it loaded again
   from `broadcasts/step_<n>` (`WeightUpdater.reload`, under the updater's lock so a new announcement is
   applied after it, not beside it). Then the gate is released.
3. The failed requests are sent again (never dropped): a rollout group is sent again whole by the scheduler,
   after the gate, so it is tagged with the version that really samples it; other calls (evals, chat-template
   probes) are re-sent by the client itself once the server is back. Counted: `inference/outages`,
   `inference/reloads`, `rollouts/resent`.

Several replicas behind a router (`inference.replicas`): when a request fails but the router answers and another
replica still serves the policy, only the replicas that do not are waited out. Rollouts go on through the router
(which the launcher has the dead replica taken out of, `prime_rl.inference.replica_restarts`); updates skip the
replicas that are down (``InferenceControl.excluded``); once one answers again it gets the served version alone
(`WeightUpdater.restore_replica`), and the launcher puts it back into the router when its version matches the
others'. The failed requests are paced by ``poll_interval`` while the router may still route to the dead one.

Why the orchestrator owns the reload (not the server, not the launcher): it already drives every filesystem
load around its request gate, which is what keeps tags exact; it knows the version it tags with; and a
server that reloaded by itself could not tell the orchestrator when it is safe to send. Push transports
(nccl, nixl) have no copy to reload from: `rl` refuses `max_restarts > 0` with them.

A server that dies in the middle of a weight update is known at once, and the updater hands the outage to the
watch (`WeightUpdater.on_unanswered`), which applies the version again once the server is back:
- the API server dies: the connection carrying the control request closes (`PeerLostError`: the control client
  watches its connection; a REQ socket alone cannot tell a dead peer from a slow load and waited out
  `orchestrator.inference.timeout`, 600 s);
- vLLM's engine core dies: the API server answers the request (a pause, a load) with an error, then exits; an error
  after which that server's own control-plane health fails (`ServerGoneError`) or the HTTP health fails (``gone``:
  vLLM answers 503 once its engine is dead) is that death, not a refused update. Behind a router only the first
  tells: the other replicas keep the HTTP route healthy;
- the server never answers (wedged): the timeout, as before;
- the server died between two requests and its restart answers the next one (ZeroMQ queues a request for a dead
  peer): the reply carries a new ``boot_id`` (`ServerRestartedError`), so that update is lost too, and the restarted
  server gets the served version back before the update is applied again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

from prime_rl.common.heartbeat import Heartbeat
from prime_rl.orchestrator.policy import PolicyState
from prime_rl.orchestrator.weights import InferenceControl, WeightUpdater

logger = logging.getLogger(__name__)


class InferenceGoneError(RuntimeError):
    """Inference did not come back within the outage deadline."""


class InferenceWatch:
    """Holds requests while inference is away and brings it back to the served policy before releasing them."""

    def __init__(
        self,
        policy: PolicyState,
        updater: WeightUpdater,
        control: InferenceControl,
        http_healthy: Callable[[], Awaitable[bool]],
        broadcasts_dir: Path,
        *,
        outage_timeout: float,
        poll_interval: float = 1.0,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        self.policy, self.updater, self.control = policy, updater, control
        self.http_healthy = http_healthy
        self.broadcasts_dir = broadcasts_dir
        self.outage_timeout, self.poll_interval = outage_timeout, poll_interval
        self.heartbeat = heartbeat if heartbeat is not None else updater.heartbeat
        self.counters: Counter[str] = Counter()
        self.failure: BaseException | None = None
        self._back = asyncio.Event()
        self._back.set()
        self._task: asyncio.Task | None = None
        self.replicas_down: dict[str, float] = {}
        """Replicas waited out while the others serve (several behind a router), with when each was found down."""
        self._replica_task: asyncio.Task | None = None
        self._probe = asyncio.Lock()  # concurrent failures probe once; ZeroMQ REQ sockets take one request at a time
        self._probed_at = -float("inf")

    @property
    def down(self) -> bool:
        return not self._back.is_set()

    async def lost(self, reason: str) -> None:
        """A request failed as if the server were gone: hold new requests and start a recovery (once)."""
        if self.failure is not None:
            raise self.failure
        async with self._probe:
            if self.down:
                return
            others_serve = await self._others_serve(reason)
            if not others_serve:
                await self._hold(reason)
        if others_serve:
            await asyncio.sleep(self.poll_interval)  # the router may still route to the dead replica for a moment

    async def _hold(self, reason: str) -> None:
        self._back.clear()
        await self.policy.hold()
        self.counters["inference/outages"] += 1
        logger.warning(
            "inference unreachable (%s): holding rollouts until it answers again (at most %.0fs)",
            reason, self.outage_timeout,
        )  # fmt: skip
        self.heartbeat.beat("waiting for inference", self.policy.version, deadline_s=self.outage_timeout, progress=True)
        self._task = asyncio.create_task(self._recover(time.monotonic()), name="inference-recovery")

    async def _others_serve(self, reason: str) -> bool:
        """With several replicas: True when the router answers and a replica still serves the policy (the ones that
        do not are then waited out alone); False means hold every request."""
        endpoints = self.control.endpoints
        if len(endpoints) < 2:
            return False
        if time.monotonic() - self._probed_at < self.poll_interval:  # failures of one death arrive together
            return bool(set(endpoints) - set(self.replicas_down))
        replies = await self.control.health()
        self._probed_at = time.monotonic()
        # a replica at an older version than the policy restarted (the model's own weights): it is down too
        serving = {
            e for e, r in zip(endpoints, replies)
            if r is not None and r.ok and r.weight_version >= self.policy.version and e not in self.replicas_down
        }  # fmt: skip
        if not serving or not await self.http_healthy():
            return False
        newly = [e for e in endpoints if e not in serving and e not in self.replicas_down]
        if newly:
            self.replicas_down.update(dict.fromkeys(newly, time.monotonic()))
            self.control.excluded.update(newly)
            self.counters["inference/outages"] += len(newly)
            logger.warning(
                "inference replica(s) %s unreachable (%s): the other %d serve on; each gets policy version %d (or "
                "the newer one served then) once it answers again (at most %.0fs)",
                ", ".join(newly), reason, len(serving), self.policy.version, self.outage_timeout,
            )  # fmt: skip
            if self._replica_task is None or self._replica_task.done():
                self._replica_task = asyncio.create_task(self._recover_replicas(), name="replica-recovery")
        return True

    async def _recover_replicas(self) -> None:
        try:
            while self.replicas_down:
                async with self._probe:
                    replies = await self.control.health()
                for endpoint, reply in zip(self.control.endpoints, replies):
                    if endpoint in self.replicas_down and reply is not None and reply.ok:
                        version = await self.updater.restore_replica(endpoint, self.broadcasts_dir)
                        outage = time.monotonic() - self.replicas_down.pop(endpoint)
                        self.counters["inference/reloads"] += bool(version)
                        self.counters["inference/outage_s"] += outage
                        logger.warning(
                            "inference replica %s answers again after %.1fs and serves policy version %d",
                            endpoint, outage, version,
                        )  # fmt: skip
                if self.replicas_down and time.monotonic() - min(self.replicas_down.values()) > self.outage_timeout:
                    raise InferenceGoneError(
                        f"inference replica(s) {', '.join(sorted(self.replicas_down))} did not come back within "
                        f"orchestrator.inference.outage_timeout={self.outage_timeout:.0f}s; see the launcher's log "
                        "for why they were not restarted, or raise inference.router.startup_timeout"
                    )
                await asyncio.sleep(self.poll_interval)
        except Exception as e:  # kept: the next lost() and every waiter raise it
            self.failure = e

    async def gone(self) -> bool:
        """Inference is going away or gone: its HTTP health fails (an error reply then came from a dying server)."""
        return not await self.http_healthy()

    async def wait(self) -> None:
        """Until inference is back (serving the policy version again); raises if it never came back."""
        await self._back.wait()
        if self.failure is not None:
            raise self.failure

    async def _recover(self, since: float) -> None:
        try:
            replies = await self._until_healthy(since)
            if any(reply.weight_version != self.policy.version for reply in replies):
                if await self.updater.reload(self.broadcasts_dir) is not None:
                    self.counters["inference/reloads"] += 1
            outage = time.monotonic() - since
            self.counters["inference/outage_s"] += outage
            logger.warning(
                "inference answers again after %.1fs, serving policy version %d: rollouts resume",
                outage, self.policy.version,
            )  # fmt: skip
            self.heartbeat.beat("rollouts", self.policy.version, progress=True)
        except Exception as e:  # kept, not raised: every waiter and the next lost() raise it
            self.failure = e
        finally:
            await self.policy.release()  # a failure must not leave waiters blocked: they see `failure` instead
            self._back.set()

    async def _until_healthy(self, since: float) -> list:
        while True:
            replies = await self.control.health()
            if await self.http_healthy() and all(r is not None and r.ok for r in replies):
                return replies
            waited = time.monotonic() - since
            if waited > self.outage_timeout:
                states = ", ".join("no answer" if r is None else f"ok={r.ok} {r.error}".strip() for r in replies)
                raise InferenceGoneError(
                    f"inference did not come back within orchestrator.inference.outage_timeout="
                    f"{self.outage_timeout:.0f}s (control planes: {states or 'none'}); see the launcher's log for "
                    "why it was not restarted, or raise inference.router.startup_timeout"
                )
            await asyncio.sleep(self.poll_interval)

    def pop_counters(self) -> Counter[str]:
        counters, self.counters = self.counters, Counter()
        return counters
