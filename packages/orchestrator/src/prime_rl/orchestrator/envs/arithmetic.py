"""arithmetic: small integer sums; reward 1 if the last integer in the completion is the sum."""

from __future__ import annotations

import re

import numpy as np

from prime_rl.orchestrator.envs.base import Environment, Messages, Task

_INTEGER = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    """The last integer written in `text` (models often explain first, answer last)."""
    found = _INTEGER.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


class ArithmeticEnv(Environment):
    name = "arithmetic"

    def __init__(self, num_terms: int = 2, max_value: int = 99):
        if num_terms < 2 or max_value < 1:
            raise ValueError(f"arithmetic needs num_terms >= 2 and max_value >= 1, got {num_terms}, {max_value}")
        self.num_terms, self.max_value = num_terms, max_value

    def sample_tasks(self, n: int, rng: np.random.Generator) -> list[Task]:
        terms = rng.integers(0, self.max_value + 1, size=(n, self.num_terms))
        return [{"terms": [int(t) for t in row], "answer": int(row.sum())} for row in terms]

    def build_prompt(self, task: Task) -> Messages:
        expression = " + ".join(str(t) for t in task["terms"])
        return [{"role": "user", "content": f"What is {expression}? Reply with the number only."}]

    def score(self, task: Task, completion_text: str) -> float:
        return 1.0 if last_integer(completion_text) == task["answer"] else 0.0
