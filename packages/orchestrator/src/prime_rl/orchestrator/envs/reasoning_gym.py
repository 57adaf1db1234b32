"""Procedural tasks from the `reasoning-gym` package (optional: `pip install prime-rl-orchestrator[envs]`).

Entries are generated locally from (name, seed, index): nothing is downloaded. A task stores only
the entry index, so tasks stay small and JSON-able; the dataset regenerates the entry on demand.
Scoring is the dataset's own `score_answer`.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from prime_rl.orchestrator.envs.base import Environment, Messages, Task

SYSTEM_PROMPT = "Solve the task. Reply with the final answer only."


class ReasoningGymEnv(Environment):
    def __init__(self, name: str, size: int = 10_000, seed: int = 0, **kwargs: Any) -> None:
        try:
            reasoning_gym = importlib.import_module("reasoning_gym")
        except ImportError as e:
            raise ImportError(
                f"env.type='reasoning_gym' needs the reasoning-gym package ({e}); "
                "pip install reasoning-gym, or pick env.type='reverse_text' / 'arithmetic'"
            ) from e
        self.name = f"reasoning_gym/{name}"
        self.dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **kwargs)
        self.size = size

    def _entry(self, task: Task) -> dict[str, Any]:
        return self.dataset[task["index"]]

    def sample_tasks(self, n: int, rng: np.random.Generator) -> list[Task]:
        return [{"index": int(i)} for i in rng.integers(0, self.size, size=n)]

    def build_prompt(self, task: Task) -> Messages:
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": self._entry(task)["question"]},
        ]

    def score(self, task: Task, completion_text: str) -> float:
        return float(self.dataset.score_answer(answer=completion_text.strip(), entry=self._entry(task)))
