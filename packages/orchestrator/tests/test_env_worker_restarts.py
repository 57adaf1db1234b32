"""A replaced environment worker's start-up is not charged to the calls waiting for it.

An environment that takes longer to build (a dataset, a reward model) than one rollout's budget used to
be killed forever after its first hang: the replacement was still starting when the next call's clock ran
out, so that call timed out, the replacement was killed and replaced in turn, and so on; every rollout
failed from then on (issue #17: a hanging reward must cost its rollouts, not the run).
"""

from __future__ import annotations

import asyncio
import os
import textwrap
import time
from pathlib import Path

import pytest

from prime_rl.orchestrator.envs.handle import Budget, EnvTimeout
from prime_rl.orchestrator.envs.worker import WorkerEnv

SLOW_START = textwrap.dedent(
    """
    import time

    from prime_rl.orchestrator.envs.reverse_text import ReverseTextEnv


    class SlowStart(ReverseTextEnv):
        name = "slow_start"

        def __init__(self, start_s: float) -> None:
            time.sleep(start_s)  # loading a dataset / a reward model
            super().__init__(min_len=3, max_len=3)

        def score(self, task, completion_text):
            if completion_text == "HANG":
                time.sleep(3600)
            return super().score(task, completion_text)
    """
)


@pytest.fixture
def slow_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    (tmp_path / "slow_start_env.py").write_text(SLOW_START)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    return {"type": "python", "entrypoint": "slow_start_env:SlowStart", "kwargs": {"start_s": 2.0}}


def test_calls_wait_for_a_replaced_worker_to_start_before_their_clock_runs(slow_env: dict) -> None:
    async def go() -> tuple[float, dict, int]:
        env = WorkerEnv(slow_env, "slow", timeout=1.0, num_workers=1)
        await env.start()  # start-up has its own, long deadline
        try:
            task = {"text": "abc", "answer": "cba"}
            with pytest.raises(EnvTimeout):
                await env.score(task, "HANG", None)  # the worker is killed and replaced (2 s to start)
            started = time.monotonic()
            budget = Budget(1.0)  # one rollout: its prompt waits for the replacement, outside the budget
            assert (await env.build_prompt(task, budget))[0]["role"] == "user"
            waited = time.monotonic() - started
            score = await env.score(task, "cba", None, budget)  # so its score still has most of the second
            assert score.reward == 1.0 and not score.failed and budget.spent < 1.0
            assert (await env.score(task, "cba", None)).reward == 1.0
            return waited, dict(env.pop_counters()), env.restarts
        finally:
            await env.close()

    waited, counters, restarts = asyncio.run(go())
    assert counters.get("timeouts") == 1 and restarts == 1, (counters, restarts)
    assert 1.0 < waited < 30, waited  # it waited out the start-up instead of timing out after 1 s


def test_a_call_during_a_replacement_goes_to_the_new_worker(slow_env: dict) -> None:
    """Killing a worker takes a moment (SIGKILL, then wait): a call made meanwhile used to pick the dying
    worker, whose reply never comes, and wait out its whole budget (seen in tests/chaos/test_hanging_reward.py
    as timeouts without a restart)."""

    async def go() -> None:
        env = WorkerEnv({**slow_env, "kwargs": {"start_s": 0.0}}, "slow", timeout=2.0, num_workers=1)
        await env.start()
        try:
            old = env.workers[0]
            replacing = asyncio.create_task(env._replace(old))
            await asyncio.sleep(0)  # the replacement is under way: the old worker is being killed
            score = await env.score({"text": "abc", "answer": "cba"}, "cba", None)
            assert score.reward == 1.0 and env.workers[0] is not old
            await replacing
        finally:
            await env.close()

    asyncio.run(go())


def test_calls_queued_behind_a_hang_run_on_the_replacement(slow_env: dict) -> None:
    """A worker serves one call at a time: the calls queued behind a hanging one never ran. They used to fail
    with it (crashes, scored 0: innocent rollouts with a negative advantage); they now run on the replacement."""

    async def go() -> tuple[list, dict, int]:
        env = WorkerEnv({**slow_env, "kwargs": {"start_s": 0.0}}, "slow", timeout=2.0, num_workers=1)
        await env.start()
        try:
            task = {"text": "abc", "answer": "cba"}

            async def score(text: str, delay: float):
                await asyncio.sleep(delay)  # sent after the hanging call, so queued behind it
                return await env.score(task, text, None)

            results = await asyncio.gather(
                score("HANG", 0.0), score("cba", 0.1), score("abc", 0.2), return_exceptions=True
            )
            return results, dict(env.pop_counters()), env.restarts
        finally:
            await env.close()

    (hung, first, second), counters, restarts = asyncio.run(go())
    assert isinstance(hung, EnvTimeout), hung
    assert first.reward == 1.0 and not first.failed and not second.failed, (first, second)
    assert counters == {"timeouts": 1, "restarts": 1}, counters
    assert restarts == 1


def test_a_call_behind_two_hangs_fails_as_a_crash(slow_env: dict) -> None:
    """Sent once more, not forever: when every call hangs, a step costs about two budgets."""

    async def go() -> tuple[list, dict]:
        env = WorkerEnv({**slow_env, "kwargs": {"start_s": 0.0}}, "slow", timeout=1.0, num_workers=1)
        await env.start()
        try:
            task = {"text": "abc", "answer": "cba"}

            async def score(delay: float):
                await asyncio.sleep(delay)
                return await env.score(task, "HANG", None)

            started = time.monotonic()
            results = await asyncio.gather(*(score(0.05 * i) for i in range(4)), return_exceptions=True)
            assert time.monotonic() - started < 10  # two budgets and a restart, not four budgets
            return results, dict(env.pop_counters())
        finally:
            await env.close()

    results, counters = asyncio.run(go())
    assert [type(r).__name__ for r in results] == ["EnvTimeout", "EnvTimeout", "_Requeued", "_Requeued"], results
    assert counters == {"timeouts": 2, "crashes": 2, "restarts": 2}, counters
