"""Environments in worker processes over ZeroMQ: a hanging, crashing or raising environment fails only the
rollout at hand (counted), the worker is replaced, and bad input fails `start()` with one line."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from prime_rl.orchestrator.envs.handle import EnvCrashed, EnvTimeout, LocalEnv
from prime_rl.orchestrator.envs.worker import WorkerEnv

HERE = Path(__file__).parent
FAULTY = {"type": "python", "entrypoint": "faulty_envs:FaultyEnv", "kwargs": {"min_len": 3, "max_len": 3}}


@pytest.fixture(autouse=True)
def importable_test_envs(monkeypatch):
    """Worker processes (and this one) import faulty_envs from this folder."""
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))


def test_worker_survives_hang_crash_and_raise():
    async def go():
        env = WorkerEnv(FAULTY, "faulty", timeout=2.0, num_workers=1)
        await env.start()
        try:
            task = {"text": "abc", "answer": "cba"}
            assert (await env.sample_tasks(2, seed=0)) == (await env.sample_tasks(2, seed=0))  # seeded
            assert (await env.build_prompt(task))[0]["role"] == "user"
            assert (await env.score(task, "cba", None)).reward == 1.0
            boom = await env.score(task, "BOOM", None)  # the scorer raised: a failed score, same worker
            assert boom.failed and "BOOM" in boom.error
            first = env.workers[0].proc.pid
            start = time.monotonic()
            with pytest.raises(EnvTimeout, match="took more than"):
                await env.score(task, "HANG", None)
            assert time.monotonic() - start < 5
            assert env.workers[0].proc.pid != first  # the hung worker was killed and replaced
            assert (await env.score(task, "cba", None)).reward == 1.0
            with pytest.raises(EnvCrashed, match="exited with 3"):
                await env.score(task, "CRASH", None)
            assert (await env.score(task, "cba", None)).reward == 1.0
            return env.pop_counters(), env.restarts
        finally:
            await env.close()

    counters, restarts = asyncio.run(go())
    assert counters["timeouts"] == 1 and counters["crashes"] == 1 and restarts == 2


def test_bad_environment_fails_start_with_one_line():
    async def start(config):
        env = WorkerEnv(config, "bad", timeout=5.0)
        with pytest.raises(ValueError) as e:
            await env.start()
        assert not env.workers
        return str(e.value)

    missing = asyncio.run(start({"type": "python", "entrypoint": "no_such_package.envs:Env"}))
    assert "cannot import 'no_such_package.envs'" in missing and "\n" not in missing
    wrong = asyncio.run(start({"type": "python", "entrypoint": "faulty_envs:not_an_env"}))
    assert "returned a int" in wrong and "Environment" in wrong


def test_local_env_times_out_without_blocking_the_loop():
    from faulty_envs import FaultyEnv

    async def go():
        env = LocalEnv(FaultyEnv(hang_s=1.5), timeout=0.5)  # a thread cannot be killed: it must end by itself
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        ticker = asyncio.create_task(tick())
        with pytest.raises(EnvTimeout):
            await env.score({"text": "abc", "answer": "cba"}, "HANG", None)
        ticker.cancel()
        return ticks

    assert asyncio.run(go()) >= 5  # the event loop kept running while the environment hung
