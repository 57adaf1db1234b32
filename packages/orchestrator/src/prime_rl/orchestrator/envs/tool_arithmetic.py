"""tool_arithmetic: a multi-turn tool task. The model calls `add` (or `multiply`), reads the result, answers.

Turn 1 the model should write a tool call (hermes format: <tool_call>{"name": "add", "arguments":
{"a": 12, "b": 30}}</tool_call>); the environment runs it and answers with a tool message; turn 2 the
model replies with the number only. Reward: 0.5 for a well-formed call of the right tool whose result
is the answer, plus 0.5 for a final reply that is exactly the answer (same strict parser as
`arithmetic`). Malformed calls are answered with an error message and earn nothing for the call.
"""

from __future__ import annotations

import numpy as np

from prime_rl.orchestrator.envs.arithmetic import parse_answer
from prime_rl.orchestrator.envs.base import Messages, Task
from prime_rl.orchestrator.envs.tool_env import ToolEnvironment


def add(a: int, b: int) -> int:
    """Add two integers."""
    return int(a) + int(b)


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return int(a) * int(b)


OPS = {"add": ("+", add), "multiply": ("*", multiply)}


class ToolArithmeticEnv(ToolEnvironment):
    name = "tool_arithmetic"

    def __init__(self, max_value: int = 99, ops: tuple[str, ...] = ("add",), max_turns: int = 3) -> None:
        unknown = [op for op in ops if op not in OPS]
        if unknown or not ops:
            raise ValueError(f"tool_arithmetic ops={list(ops)} must be a non-empty subset of {sorted(OPS)}")
        super().__init__([OPS[op][1] for op in ops], max_turns=max_turns)
        self.max_value, self.ops = max_value, tuple(ops)

    def sample_tasks(self, n: int, rng: np.random.Generator) -> list[Task]:
        tasks = []
        for _ in range(n):
            op = self.ops[int(rng.integers(len(self.ops)))]
            a, b = (int(x) for x in rng.integers(0, self.max_value + 1, size=2))
            tasks.append({"op": op, "a": a, "b": b, "answer": OPS[op][1](a, b)})
        return tasks

    def build_prompt(self, task: Task) -> Messages:
        symbol = OPS[task["op"]][0]
        return [
            {
                "role": "user",
                "content": f"What is {task['a']} {symbol} {task['b']}? Call the {task['op']} tool, "
                "then reply with the number only.",
            }
        ]

    def score_rollout(self, task: Task, messages: Messages) -> float:
        called = any(
            m["role"] == "tool" and parse_answer(str(m.get("content", ""))) == task["answer"] for m in messages
        )
        last = next((m for m in reversed(messages) if m["role"] == "assistant"), {})
        answered = not last.get("tool_calls") and parse_answer(last.get("content") or "") == task["answer"]
        return 0.5 * called + 0.5 * answered

    def score(self, task: Task, completion_text: str) -> float:
        return 1.0 if parse_answer(completion_text) == task["answer"] else 0.0
