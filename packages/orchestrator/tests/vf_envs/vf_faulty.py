"""A verifiers (v1) taskset for the tests: add two numbers, with an `add` tool when `task.tools`; its reward
misbehaves on demand (the reply HANG, CRASH or RAISE) so the tests see what a bad env costs; a `@vf.stop` ends
the rollout once two tool results are in."""

from __future__ import annotations

import os
import time

import verifiers.v1 as vf


class FaultyData(vf.TaskData):
    answer: int


class Adder(vf.Toolset[vf.ToolsetConfig]):
    """Named tools: the model sees `adder_add` (verifiers' `<server>_<tool>`)."""

    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class FaultyTaskConfig(vf.TaskConfig):
    tools: bool = False


class FaultyTask(vf.Task[FaultyData, vf.State, FaultyTaskConfig]):
    @classmethod
    def toolsets(cls, config: FaultyTaskConfig) -> list[vf.Toolset]:
        return [Adder(vf.ToolsetConfig())] if config.tools else []

    @vf.reward(weight=2.0)
    async def correct(self, trace: vf.Trace) -> float:
        if trace.last_reply == "HANG":
            time.sleep(60)
        if trace.last_reply == "CRASH":
            os._exit(3)
        if trace.last_reply == "RAISE":
            raise RuntimeError("reward function failed")
        return float(trace.last_reply == str(self.data.answer))

    @vf.stop
    async def two_calls(self, trace: vf.Trace) -> bool:
        return len(trace.tool_messages) >= 2

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class FaultyConfig(vf.TasksetConfig):
    num_tasks: int = 4
    task: FaultyTaskConfig = FaultyTaskConfig()


class FaultyTaskset(vf.Taskset[FaultyTask, FaultyConfig]):
    def load(self) -> list[FaultyTask]:
        return [
            FaultyTask(FaultyData(prompt=f"{i} + 1?", system_prompt="Be brief.", answer=i + 1), self.config.task)
            for i in range(self.config.num_tasks)
        ]


__all__ = ["FaultyTaskset"]
