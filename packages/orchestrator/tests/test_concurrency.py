"""Rollout concurrency follows inference load: the vLLM queue gauge is read from /metrics, the limit moves by
AIMD within [lo, max_concurrent_groups] (lo = 2 in the scheduler), lowered only while more requests wait
than run, and the scheduler keeps no more groups in flight than the limit."""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np
import pytest

from prime_rl.orchestrator.client import ChatResult, SamplingArgs
from prime_rl.orchestrator.concurrency import LoadLimit, ServerLoad, parse_vllm_metrics
from prime_rl.orchestrator.envs.handle import LocalEnv
from prime_rl.orchestrator.envs.reverse_text import ReverseTextEnv
from prime_rl.orchestrator.policy import PolicyState
from prime_rl.orchestrator.rollout import Completion
from prime_rl.orchestrator.scheduler import RolloutScheduler

# What vLLM serves (two DP engines; HELP/TYPE lines and other metrics around the gauges)
METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 16.0
vllm:num_requests_running{engine="1",model_name="m"} 12.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.97
vllm:prompt_tokens_total{engine="0",model_name="m"} 12345.0
vllm:generation_tokens_total{engine="0",model_name="m"} 700.0
vllm:generation_tokens_total{engine="1",model_name="m"} 300.0
"""


def test_parse_vllm_metrics():
    assert parse_vllm_metrics(METRICS) == ServerLoad(waiting=3.0, running=28.0, kv_usage=0.97, generated=1000.0)
    assert parse_vllm_metrics("# a router's metrics\nrouter_requests_total 5\n") is None


def test_limit_moves_by_aimd_within_bounds():
    async def go() -> list[int]:
        limit = LoadLimit(1, 16)
        idle, queued = ServerLoad(0, 4, 0.5), ServerLoad(40, 32, 0.5)
        seen = [limit.limit]
        seen.append(await limit.update(queued))  # one burst: not yet
        seen.append(await limit.update(queued))  # queued twice in a row: x 3/4
        seen.append(await limit.update(queued))
        seen.append(await limit.update(idle))  # idle but slots not all in use: stays
        for _ in range(9):
            await limit.acquire()
        seen.append(await limit.update(idle))  # every slot busy, queue empty: + limit / 4
        seen.append(await limit.update(ServerLoad(0, 4, 0.95)))  # KV cache nearly full: stays
        for _ in range(20):
            await limit.update(queued)
        seen.append(limit.limit)
        return seen

    assert asyncio.run(go()) == [16, 16, 12, 9, 9, 11, 11, 1]


def test_a_paused_server_does_not_lower_the_limit():
    """During a weight update the server queues requests without generating: that is not a capacity signal."""

    async def go() -> list[int]:
        limit = LoadLimit(1, 16)
        seen = []
        for generated in (100, 100, 100, 100, 140, 180):  # paused for 3 probes, then generating again
            seen.append(await limit.update(ServerLoad(24, 16, 0.5, generated=float(generated))))
        for _ in range(12):
            await limit.acquire()  # every slot busy
        seen.append(await limit.update(ServerLoad(24, 16, 0.5, generated=180.0)))  # paused: no increase either
        return seen

    assert asyncio.run(go()) == [16, 16, 16, 16, 16, 12, 12]
    with pytest.raises(ValueError, match="need 1 <= lo <= hi"):
        LoadLimit(0, 4)


def test_a_queue_shorter_than_the_batch_keeps_the_limit():
    """A short queue refills freed slots at once; only a queue longer than the batch lowers the limit, and never
    below lo: with one group filling the batch (group_size >= max_num_seqs) two groups keep the server busy."""

    async def go() -> list[int]:
        limit = LoadLimit(2, 16)
        seen = []
        for _ in range(5):  # 16 queued behind a full batch of 16: the next group waits, that is fine
            seen.append(await limit.update(ServerLoad(16, 16, 0.5)))
        for _ in range(20):  # three batches waiting
            seen.append(await limit.update(ServerLoad(48, 16, 0.5)))
        return seen

    seen = asyncio.run(go())
    assert seen[:5] == [16] * 5
    assert seen[-1] == 2 and min(seen) == 2


def test_groups_waiting_for_the_policy_do_not_raise_the_limit():
    """With max_off_policy_steps = 0 the next step's groups hold their slots while waiting for the new weights,
    and the server is idle meanwhile: that is no sign of spare capacity (the limit would climb back to the
    ceiling at every step boundary and the next step would flood the queue)."""

    async def go() -> list[int]:
        limit = LoadLimit(2, 16)
        for _ in range(4):
            await limit.update(ServerLoad(48, 16, 0.5))  # overloaded: 16 -> 12 -> 9 -> 6
        for _ in range(limit.limit):
            await limit.acquire()
        seen = [limit.limit]
        with contextlib.ExitStack() as parked:
            for _ in range(limit.limit):
                parked.enter_context(limit.parked_while())
            for _ in range(3):
                seen.append(await limit.update(ServerLoad(0, 0, 0.0)))  # idle server, every holder parked
        seen.append(await limit.update(ServerLoad(0, 4, 0.1)))  # the same holders now sampling, no queue: grows
        return seen

    assert asyncio.run(go()) == [6, 6, 6, 6, 7]


class Server:
    """A fake vLLM engine: a group's `n` samples are `n` sequences; at most `capacity` (its max_num_seqs) run at
    once, each for `seq_s`, the rest wait. /metrics reports both counts, as vLLM does."""

    def __init__(self, capacity: int, seq_s: float = 0.02) -> None:
        self.capacity, self.seq_s = capacity, seq_s
        self.slots = asyncio.Semaphore(capacity)
        self.in_flight = self.peak_late = self.requests = 0
        self.running = self.waiting = 0

    async def _sequence(self) -> None:
        self.waiting += 1
        async with self.slots:
            self.waiting -= 1
            self.running += 1
            await asyncio.sleep(self.seq_s)
            self.running -= 1

    async def sample(self, messages, n: int, sampling: SamplingArgs) -> ChatResult:
        self.in_flight += 1
        self.requests += 1
        if self.requests > 100:  # after the limit had time to react
            self.peak_late = max(self.peak_late, self.in_flight)
        await asyncio.gather(*(self._sequence() for _ in range(n)))
        self.in_flight -= 1
        completions = [Completion([7 + i], [-0.5], f"answer {i}", finish_reason="stop") for i in range(n)]
        return ChatResult(prompt_ids=[1, 2, 3], completions=completions)

    server_root = "http://fake"

    async def metrics_text(self) -> str:
        return f"vllm:num_requests_waiting {self.waiting}.0\nvllm:num_requests_running {self.running}.0\n"


def _run_scheduler(follow_load: bool, group_size: int, capacity: int) -> tuple[int, dict, float]:
    """(peak groups in flight once the limit settled, the scheduler's metrics, seconds for 160 groups)."""

    async def go() -> tuple[int, dict, float]:
        server = Server(capacity=capacity)
        scheduler = RolloutScheduler(
            LocalEnv(ReverseTextEnv(), timeout=5.0),
            server,
            PolicyState(version=0),
            np.random.default_rng(0),
            SamplingArgs(max_tokens=4, temperature=1.0),
            group_size=group_size,
            groups_per_step=16,
            max_off_policy_steps=100,  # never gated: version 0 serves throughout
            max_concurrent=16,
            follow_load=follow_load,
        )
        start = time.perf_counter()
        scheduler.start()
        try:
            for _ in range(160):
                await asyncio.wait_for(scheduler.get(), timeout=30)
        finally:
            await scheduler.close()
        return server.peak_late, scheduler.pop_metrics(), time.perf_counter() - start

    return asyncio.run(go())


@pytest.fixture
def fast_probe(monkeypatch):
    import prime_rl.orchestrator.scheduler as scheduler_module

    real = scheduler_module.follow_load
    monkeypatch.setattr(scheduler_module, "follow_load", lambda limit, fetch, where: real(limit, fetch, where, 0.02))


def test_scheduler_keeps_fewer_groups_in_flight_while_the_server_queues(fast_probe):
    fixed_peak, fixed_metrics, fixed_s = _run_scheduler(False, group_size=2, capacity=4)
    peak, metrics, load_s = _run_scheduler(True, group_size=2, capacity=4)
    assert fixed_peak == 16 and "rollouts/concurrency_limit" not in fixed_metrics
    # settles near the server's batch (2 groups of 2) instead of queueing 28 sequences; AIMD probes a little above
    assert peak <= 6, peak
    assert 2 <= metrics["rollouts/concurrency_limit"] <= 5
    # and the server stays as busy as with every group queued (160 groups x 2 sequences / 4 slots x 20 ms = 1.6 s)
    assert load_s < 1.25 * fixed_s, (load_s, fixed_s)


def test_a_group_that_fills_the_batch_keeps_two_groups_in_flight(fast_probe):
    """group_size 8 on a server batching 8: every second group queues, yet the limit holds at 2-3 groups (one
    generating, one scored or queued next), not 1, which would leave the server idle while a group is scored."""
    _, _, fixed_s = _run_scheduler(False, group_size=8, capacity=8)
    peak, metrics, load_s = _run_scheduler(True, group_size=8, capacity=8)
    assert 2 <= peak <= 4, peak
    assert 2 <= metrics["rollouts/concurrency_limit"] <= 3
    assert load_s < 1.25 * fixed_s, (load_s, fixed_s)
