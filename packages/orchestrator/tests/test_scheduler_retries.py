"""Synchronous rollouts (`max_off_policy_steps = 0`) survive a discarded group: the step still fills.

A group is discarded when its environment fails to give a task or prompt (raised, timed out, or its worker
was killed for another call's hang) or inference aborts it. Its ticket (the step it was meant for) used to be
lost: the step came up one group short while later tickets waited for the next policy version, which needs
this step's batch first, so the run deadlocked (issue #17: "rollout failures in synchronous mode are retried
or counted, never deadlock"). The ticket is now retried with a fresh task, and the failure counted.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from prime_rl.orchestrator import scheduler as scheduler_module
from prime_rl.orchestrator.client import ChatResult, PromptTooLongError, SamplingArgs
from prime_rl.orchestrator.envs.handle import LocalEnv
from prime_rl.orchestrator.envs.reverse_text import ReverseTextEnv
from prime_rl.orchestrator.policy import PolicyState
from prime_rl.orchestrator.rollout import Completion
from prime_rl.orchestrator.scheduler import RolloutScheduler


class FailingPrompts(ReverseTextEnv):
    """reverse_text whose build_prompt raises on its first ``fail`` calls."""

    name = "failing"

    def __init__(self, fail: int) -> None:
        super().__init__()
        self.fail, self.calls, self.lock = fail, 0, threading.Lock()

    def build_prompt(self, task):
        with self.lock:
            self.calls += 1
            if self.calls <= self.fail:
                raise RuntimeError(f"prompt service down (call {self.calls})")
        return super().build_prompt(task)


class FakeClient:
    """Answers every request with n distinct completions (so groups have signal)."""

    async def sample(self, messages, n: int, sampling: SamplingArgs) -> ChatResult:
        await asyncio.sleep(0.01)
        completions = [Completion([7 + i], [-0.5], f"answer {i}", finish_reason="stop") for i in range(n)]
        return ChatResult(prompt_ids=[1, 2, 3], completions=completions)


def _scheduler(client, env: ReverseTextEnv | None = None) -> RolloutScheduler:
    """Synchronous steps of 3 groups of 2 on ``env`` (reverse_text by default)."""
    return RolloutScheduler(
        LocalEnv(env or ReverseTextEnv(), timeout=5.0), client, PolicyState(version=0), np.random.default_rng(0),
        SamplingArgs(max_tokens=4, temperature=1.0), group_size=2, groups_per_step=3, max_off_policy_steps=0,
        max_concurrent=3,
    )  # fmt: skip


def test_a_discarded_group_is_retried_so_a_synchronous_step_fills() -> None:
    async def go() -> tuple[list, dict]:
        scheduler = _scheduler(FakeClient(), FailingPrompts(fail=2))
        scheduler.start()
        try:
            # Before the fix: 1 of 3 groups for step 0, the next tickets gated on version 1 (never served).
            groups = [await asyncio.wait_for(scheduler.get(), timeout=10) for _ in range(3)]
        finally:
            await scheduler.close()
        return groups, dict(scheduler.pop_counters())

    groups, counters = asyncio.run(go())
    assert len(groups) == 3 and all(g.version == 0 for g in groups)
    assert counters["env/prompt_failed"] == 2  # counted, and the step filled all the same


class TooLongFirst(FakeClient):
    """Refuses the first ``refuse`` requests as vLLM refuses a prompt longer than max_model_len."""

    def __init__(self, refuse: int) -> None:
        self.refuse, self.calls = refuse, 0

    async def sample(self, messages, n: int, sampling: SamplingArgs) -> ChatResult:
        self.calls += 1
        if self.calls <= self.refuse:
            raise PromptTooLongError("HTTP 400: This model's maximum context length is 8 tokens")
        return await super().sample(messages, n, sampling)


def test_a_prompt_over_max_model_len_is_counted_and_its_task_skipped(caplog) -> None:
    async def go() -> tuple[list, dict]:
        scheduler = _scheduler(TooLongFirst(refuse=2))
        scheduler.start()
        try:
            groups = [await asyncio.wait_for(scheduler.get(), timeout=10) for _ in range(3)]
        finally:
            await scheduler.close()
        return groups, dict(scheduler.pop_counters())

    groups, counters = asyncio.run(go())
    assert len(groups) == 3 and counters["rollouts/prompt_too_long"] == 2  # the step filled with other tasks
    skipped = [r.getMessage() for r in caplog.records if "does not fit inference.vllm.max_model_len" in r.getMessage()]
    assert len(skipped) == 2 and all("environment reverse_text task" in m for m in skipped)


def test_prompts_that_never_fit_stop_the_run_naming_the_keys(monkeypatch) -> None:
    monkeypatch.setattr(scheduler_module, "MAX_TOO_LONG_STREAK", 5)

    async def go() -> None:
        scheduler = _scheduler(TooLongFirst(refuse=10**9))
        scheduler.start()
        try:
            await asyncio.wait_for(scheduler.get(), timeout=10)
        finally:
            await scheduler.close()

    with pytest.raises(PromptTooLongError, match="prompts in a row do not fit inference.vllm.max_model_len"):
        asyncio.run(go())
