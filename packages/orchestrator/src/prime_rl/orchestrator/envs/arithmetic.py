"""arithmetic: small integer sums; reward 1 if the completion is exactly the sum, else 0.

The prompt asks for "the number only", and the score holds the model to it: the completion, stripped
of surrounding whitespace, must be the answer written in plain decimal (``-?[0-9]+``, no leading
zeros, no words, no second number). Looser parsing (e.g. the last integer in the text) pays for
answers like "3 4 9" or "junk 7", and RL then learns to exploit the parser instead of adding.
"""

from __future__ import annotations

import re

import numpy as np

from prime_rl.orchestrator.envs.base import Environment, Messages, Task

_ANSWER = re.compile(r"-?(0|[1-9][0-9]*)")


def parse_answer(text: str) -> int | None:
    """The integer `text` is, or None unless it is exactly one plain decimal integer (whitespace around allowed)."""
    text = text.strip()
    return int(text) if _ANSWER.fullmatch(text) else None


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
        return 1.0 if parse_answer(completion_text) == task["answer"] else 0.0
