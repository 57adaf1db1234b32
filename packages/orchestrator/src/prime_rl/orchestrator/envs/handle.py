"""How the orchestrator calls an environment: an async `EnvHandle`, in a worker process or in a thread.

Every call an environment serves for a rollout (draw tasks, build the prompt, answer a turn, score) is
awaited with a deadline, so a slow, hanging or crashing environment fails that rollout (counted in
`env/<name>/timeouts` / `env/<name>/crashes` / `env/<name>/failed`) and never blocks the event loop or
stops the run. `WorkerEnv` (worker.py) runs the environment in its own processes over ZeroMQ and kills a
worker that overruns; `LocalEnv` runs it in threads (a hung thread cannot be killed: tests and trusted
environments only).

Task sampling takes a seed rather than the orchestrator's rng: the scheduler draws the seed
synchronously, so the task sequence depends only on the rng, wherever the environment runs.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prime_rl.orchestrator.envs.base import Environment, Messages, MultiTurnEnvironment, Score, Task, score_safely
from prime_rl.orchestrator.tools import ToolCall


class EnvFailure(RuntimeError):
    """An environment call failed for one rollout (it raised, timed out, or its worker died)."""

    kind = "failed"


class EnvTimeout(EnvFailure):
    kind = "timeouts"


class EnvCrashed(EnvFailure):
    kind = "crashes"


@dataclass(frozen=True)
class EnvInfo:
    """What the orchestrator needs to know about an environment before any rollout."""

    name: str
    multi_turn: bool = False
    max_turns: int = 1
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_call_parser: str = "hermes"

    @classmethod
    def of(cls, env: Environment, name: str | None = None) -> EnvInfo:
        if isinstance(env, MultiTurnEnvironment):
            return cls(name or env.name, True, env.max_turns, list(env.tools), env.tool_call_parser)
        return cls(name or env.name)


class Budget:
    """One rollout's time in the environment: each call gets what is left of `timeout` seconds."""

    def __init__(self, timeout: float) -> None:
        self.timeout, self.spent = timeout, 0.0

    @property
    def left(self) -> float:
        return self.timeout - self.spent


class EnvHandle(ABC):
    """Async access to one environment; `name` and `weight` come from its `[[orchestrator.env]]` entry."""

    def __init__(self, name: str, weight: float = 1.0, timeout: float = 60.0) -> None:
        self.name, self.weight, self.timeout = name, weight, timeout
        self.info = EnvInfo(name)
        self.counters: Counter[str] = Counter()

    async def start(self) -> None:  # noqa: B027 (optional hook: in-process environments have nothing to start)
        """Start workers and learn the environment's info; raises one clear error for bad input."""

    async def close(self) -> None:  # noqa: B027 (optional hook)
        """Stop workers."""

    async def until_started(self) -> None:  # noqa: B027 (optional hook: in-process environments are always up)
        """Wait until the environment can take a call (a worker replacing a killed one may still be starting)."""

    async def call(self, method: str, args: dict[str, Any], budget: Budget | None = None) -> Any:
        """Run one environment call within the budget; raise EnvFailure (and count it) otherwise."""
        budget = budget or Budget(self.timeout)
        # A worker's start-up is not the rollout's time: with it charged, an environment that builds slower than
        # one budget failed every rollout after its first hang (its replacements timed out while starting).
        await self.until_started()
        if budget.left <= 0:
            self.counters["timeouts"] += 1
            raise EnvTimeout(f"environment {self.name} used its {self.timeout:.0f}s budget for this rollout")
        start = time.monotonic()
        try:
            return await self._call(method, args, budget.left)
        except EnvFailure as e:
            self.counters[e.kind] += 1
            raise
        finally:
            budget.spent += time.monotonic() - start

    @abstractmethod
    async def _call(self, method: str, args: dict[str, Any], timeout: float) -> Any:
        """Run `method` (see `dispatch`) with `args`; raise EnvTimeout / EnvCrashed / EnvFailure."""

    async def sample_tasks(self, n: int, seed: int) -> list[Task]:
        return await self.call("sample_tasks", {"n": n, "seed": seed})

    async def build_prompt(self, task: Task, budget: Budget | None = None) -> Messages:
        return await self.call("build_prompt", {"task": task}, budget)

    async def env_response(
        self, task: Task, messages: Messages, calls: list[ToolCall], budget: Budget | None = None
    ) -> Messages | None:
        raw = [{"id": c.id, "name": c.name, "arguments": c.arguments, "raw": c.raw, "error": c.error} for c in calls]
        return await self.call("env_response", {"task": task, "messages": messages, "calls": raw}, budget)

    async def score(self, task: Task, text: str, messages: Messages | None, budget: Budget | None = None) -> Score:
        reward, failed, error = await self.call("score", {"task": task, "text": text, "messages": messages}, budget)
        return Score(reward, failed, error)

    def pop_counters(self) -> Counter[str]:
        counters, self.counters = self.counters, Counter()
        return counters


def dispatch(env: Environment, method: str, args: dict[str, Any]) -> Any:
    """Run one call on an environment object (in a worker process or a thread); returns JSON-able data."""
    if method == "sample_tasks":
        return env.sample_tasks(args["n"], np.random.default_rng(args["seed"]))
    if method == "build_prompt":
        return env.build_prompt(args["task"])
    if method == "env_response":
        if not isinstance(env, MultiTurnEnvironment):
            raise TypeError(f"environment {env.name} is single-turn: it has no env_response")
        calls = [ToolCall(**c) for c in args["calls"]]
        return env.env_response(args["task"], args["messages"], calls)
    if method == "score":
        s = score_safely(env, args["task"], args["text"], args["messages"])
        return [s.reward, s.failed, s.error]
    if method == "info":
        info = EnvInfo.of(env)
        return {
            "name": info.name,
            "multi_turn": info.multi_turn,
            "max_turns": info.max_turns,
            "tools": info.tools,
            "tool_call_parser": info.tool_call_parser,
        }
    raise ValueError(f"unknown environment method {method!r}")


class LocalEnv(EnvHandle):
    """An environment object in this process; calls run in threads (off the event loop), with deadlines."""

    def __init__(self, env: Environment, name: str | None = None, weight: float = 1.0, timeout: float = 60.0):
        super().__init__(name or env.name, weight, timeout)
        self.env = env
        self.info = EnvInfo.of(env, self.name)

    async def _call(self, method: str, args: dict[str, Any], timeout: float) -> Any:
        future = asyncio.ensure_future(asyncio.to_thread(dispatch, self.env, method, args))
        if not (await wait_at_most(future, timeout)):
            raise EnvTimeout(f"environment {self.name}.{method} took more than {timeout:.1f}s")
        try:
            return future.result()
        except Exception as e:
            raise EnvFailure(f"environment {self.name}.{method} raised {type(e).__name__}: {e}") from e


async def wait_at_most(future: asyncio.Future, timeout: float) -> bool:
    """True once `future` is done, False after `timeout` seconds (it keeps running). Not `asyncio.wait_for`:
    on Python 3.11 that can swallow a cancellation that arrives as the future completes, and a rollout
    worker that misses its cancellation runs on after the scheduler stopped (seen as a hung shutdown)."""
    done, _ = await asyncio.wait({future}, timeout=timeout)
    return bool(done)


def pick_env(envs: list[EnvHandle], rng: np.random.Generator) -> EnvHandle:
    """One environment, drawn by weight (no draw, so no rng use, when there is only one)."""
    if len(envs) == 1:
        return envs[0]
    weights = np.asarray([e.weight for e in envs], dtype=np.float64)
    return envs[int(rng.choice(len(envs), p=weights / weights.sum()))]
