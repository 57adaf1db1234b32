"""Add two numbers. With `tools = true` the model gets an `add` tool (a multi-turn tool task: call, read the
result, answer); without, it answers in one turn. Tasks are generated from `seed`: no downloads.

Rewards (the taskset's rubric, summed by verifiers with their weights): `correct` (weight 1) when the last
reply is exactly the sum, and with tools `used_tool` (weight 0.5) when a tool result was the sum.
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")


def parse_int(text: str) -> int | None:
    """The integer `text` is (whitespace around allowed), else None: "12 + 3 = 15" earns nothing."""
    text = text.strip()
    return int(text) if _INTEGER.fullmatch(text) else None


class ArithmeticData(vf.TaskData):
    a: int
    b: int
    answer: int


class AddToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the model sees `add`, not `add_toolset_add`

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(int(a) + int(b))


class ArithmeticTaskConfig(vf.TaskConfig):
    tools: bool = False
    """Give the model the `add` tool (multi-turn) instead of asking for the answer directly."""


class ArithmeticTask(vf.Task[ArithmeticData, vf.State, ArithmeticTaskConfig]):
    @classmethod
    def toolsets(cls, config: ArithmeticTaskConfig) -> list[vf.Toolset]:
        return [AddToolset(vf.ToolsetConfig())] if config.tools else []

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(parse_int(trace.last_reply) == self.data.answer)

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        if not self.config.tools:
            return 0.0
        return float(any(parse_int(str(m.content)) == self.data.answer for m in trace.tool_messages))


class ArithmeticConfig(vf.TasksetConfig):
    num_tasks: int = 100
    """Tasks generated."""
    max_value: int = 9
    """Operands are drawn from 0..max_value."""
    seed: int = 0
    """Seed of the task generator."""
    task: ArithmeticTaskConfig = ArithmeticTaskConfig()


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, ArithmeticConfig]):
    def load(self) -> list[ArithmeticTask]:
        rng = random.Random(self.config.seed)
        tasks = []
        for i in range(self.config.num_tasks):
            a, b = rng.randint(0, self.config.max_value), rng.randint(0, self.config.max_value)
            how = "Call the add tool, then reply" if self.config.task.tools else "Reply"
            prompt = f"What is {a} + {b}? {how} with the number only."
            data = ArithmeticData(id=f"add-{i}", prompt=prompt, a=a, b=b, answer=a + b)
            tasks.append(ArithmeticTask(data, self.config.task))
        return tasks
