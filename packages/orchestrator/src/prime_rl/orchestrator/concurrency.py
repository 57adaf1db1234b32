"""Rollout concurrency that follows inference load: how many groups the scheduler keeps in flight.

vLLM batches up to `max_num_seqs` requests and queues the rest (`vllm:num_requests_waiting` on its
Prometheus `/metrics`). A short queue is useful: a slot that frees is refilled at once. A queue longer than
the batch buys nothing: those requests wait at least one whole batch, are sampled later than their
version tag says, and crowd out other runs sharing the servers. So the limit moves by AIMD on that
signal, probed every `interval_s`:

- more requests waited than ran, at two probes in a row (one burst of `n` sampled children is normal),
  while the server generated tokens (`vllm:generation_tokens_total` grew: a server paused for a weight
  update queues without generating, and that says nothing about its capacity) -> limit x 3/4, at least
  `lo`;
- the queue was empty, the KV cache below 90% and every slot in use by a group that is sampling or being
  scored -> limit + max(1, limit / 4) (at most `hi`). A group waiting for a newer policy version holds
  its slot (`parked`) but not the server: counting it would raise the limit on an idle server at every
  step boundary, and the next step would flood the queue (measured: 32 -> 13 -> 32 each step);
- the server had requests but generated nothing since the last probe (paused) -> unchanged.

Why "longer than the batch" and the floor `lo` (2 in the scheduler): when one group's `n` samples fill
the engine's batch (`group_size` >= `max_num_seqs`), any second group queues. Lowering on any queue
would sink the limit to one group, and the server would idle while that group is scored; with two groups
one generates while the other is scored, and their queue is never longer than the batch unless a
group is more than twice the batch.

It starts at `hi` (the configured `max_concurrent_groups`), so a run on idle servers behaves exactly as
with a fixed limit. Where `/metrics` has no vLLM queue gauge (a router in front, another server), the
limit stays at `hi` and that is logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class ServerLoad:
    waiting: float
    running: float
    kv_usage: float | None
    generated: float | None = None
    """Tokens generated since the server started (a counter); None when not reported."""


def parse_vllm_metrics(text: str) -> ServerLoad | None:
    """Requests waiting / running (summed over engines) and the fullest KV cache, from vLLM's /metrics text."""
    values: dict[str, list[float]] = {}
    for name, value in _SAMPLE.findall(text):
        values.setdefault(name, []).append(float(value))
    if "vllm:num_requests_waiting" not in values:
        return None
    kv = values.get("vllm:kv_cache_usage_perc") or values.get("vllm:gpu_cache_usage_perc")
    generated = values.get("vllm:generation_tokens_total")
    return ServerLoad(
        waiting=sum(values["vllm:num_requests_waiting"]),
        running=sum(values.get("vllm:num_requests_running", [0.0])),
        kv_usage=max(kv) if kv else None,
        generated=sum(generated) if generated else None,
    )


class LoadLimit:
    """An asyncio limit on groups in flight whose size `update` moves with the server's load."""

    def __init__(self, lo: int, hi: int) -> None:
        if not 1 <= lo <= hi:
            raise ValueError(f"concurrency bounds lo={lo}, hi={hi}: need 1 <= lo <= hi")
        self.lo, self.hi = lo, hi
        self.limit = hi
        self.in_flight = 0
        self.parked = 0
        """Holders waiting for something other than the server (a newer policy version): see `parked_while`."""
        self._overloaded_before = False
        self._generated: float | None = None
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

    async def update(self, load: ServerLoad) -> int:
        """Apply one probe's load; returns the new limit."""
        async with self._cond:
            stalled = None not in (load.generated, self._generated) and load.generated <= self._generated
            self._generated = load.generated
            if stalled and load.waiting + load.running > 0:  # paused (weight update): no capacity signal either way
                self._overloaded_before = False
                return self.limit
            queued = load.waiting > 0
            overloaded = load.waiting > load.running  # more than one batch waits: see the module docstring
            busy = self.in_flight - self.parked >= self.limit  # every slot sampling or scoring, none parked
            kv_room = load.kv_usage is None or load.kv_usage < 0.9
            if overloaded and self._overloaded_before:
                self.limit = max(self.lo, math.floor(self.limit * 3 / 4))
            elif not queued and busy and kv_room:
                self.limit = min(self.hi, self.limit + max(1, self.limit // 4))
                self._cond.notify_all()
            self._overloaded_before = overloaded
            return self.limit


async def follow_load(
    limit: LoadLimit, fetch: Callable[[], Awaitable[str | None]], where: str, interval_s: float = 1.0
) -> None:
    """Read the server's /metrics text with `fetch` every `interval_s` and move `limit`, until cancelled.
    A probe that fails leaves the limit where it is (a server that is down shows up in the requests)."""
    warned = False
    while True:
        text = await fetch()
        load = parse_vllm_metrics(text) if text is not None else None
        if load is None:
            if not warned:
                logger.info("no vLLM request-queue gauge at %s: rollout concurrency stays at %d", where, limit.limit)
                warned = True
        else:
            before = limit.limit
            after = await limit.update(load)
            if after != before:
                logger.info(
                    "rollout concurrency %d -> %d groups (server: %d waiting, %d running)",
                    before, after, load.waiting, load.running,
                )  # fmt: skip
        await asyncio.sleep(interval_s)
