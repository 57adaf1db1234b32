"""Rollout concurrency follows inference load: the vLLM queue gauge is read from /metrics, the limit moves by
AIMD within [1, max_concurrent_groups], and the scheduler keeps no more groups in flight than the limit."""

from __future__ import annotations

import asyncio

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
        idle, queued = ServerLoad(0, 4, 0.5), ServerLoad(8, 32, 0.5)
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
            seen.append(await limit.update(ServerLoad(8, 16, 0.5, generated=float(generated))))
        for _ in range(12):
            await limit.acquire()  # every slot busy
        seen.append(await limit.update(ServerLoad(8, 16, 0.5, generated=180.0)))  # paused: no increase either
        return seen

    assert asyncio.run(go()) == [16, 16, 16, 16, 16, 12, 12]
    with pytest.raises(ValueError, match="need 1 <= lo <= hi"):
        LoadLimit(0, 4)


class Server:
    """A fake server that counts requests in flight and reports a queue while more than `capacity` are."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.in_flight, self.peak_late = capacity, 0, 0
        self.requests = 0

    async def sample(self, messages, n: int, sampling: SamplingArgs) -> ChatResult:
        self.in_flight += 1
        self.requests += 1
        if self.requests > 100:  # after the limit had time to react
            self.peak_late = max(self.peak_late, self.in_flight)
        await asyncio.sleep(0.05)
        self.in_flight -= 1
        completions = [Completion([7 + i], [-0.5], f"answer {i}", finish_reason="stop") for i in range(n)]
        return ChatResult(prompt_ids=[1, 2, 3], completions=completions)

    server_root = "http://fake"

    async def metrics_text(self) -> str:
        waiting = max(0, self.in_flight - self.capacity)
        return f"vllm:num_requests_waiting {waiting}.0\nvllm:num_requests_running {min(self.in_flight, 2)}.0\n"


def test_scheduler_keeps_fewer_groups_in_flight_while_the_server_queues(monkeypatch):
    import prime_rl.orchestrator.scheduler as scheduler_module

    real = scheduler_module.follow_load
    monkeypatch.setattr(scheduler_module, "follow_load", lambda limit, fetch, where: real(limit, fetch, where, 0.02))

    async def go(follow_load: bool) -> tuple[int, dict]:
        server = Server(capacity=2)
        scheduler = RolloutScheduler(
            LocalEnv(ReverseTextEnv(), timeout=5.0),
            server,
            PolicyState(version=0),
            np.random.default_rng(0),
            SamplingArgs(max_tokens=4, temperature=1.0),
            group_size=2,
            groups_per_step=16,
            max_off_policy_steps=100,  # never gated: version 0 serves throughout
            max_concurrent=16,
            follow_load=follow_load,
        )
        scheduler.start()
        try:
            for _ in range(160):
                await asyncio.wait_for(scheduler.get(), timeout=10)
        finally:
            await scheduler.close()
        return server.peak_late, scheduler.pop_metrics()

    fixed_peak, fixed_metrics = asyncio.run(go(False))
    peak, metrics = asyncio.run(go(True))
    assert fixed_peak == 16 and "rollouts/concurrency_limit" not in fixed_metrics
    # settles near the server's capacity (2) instead of queueing 14 requests; AIMD keeps probing a little above it
    assert peak <= 6, peak
    assert 1 <= metrics["rollouts/concurrency_limit"] <= 5
