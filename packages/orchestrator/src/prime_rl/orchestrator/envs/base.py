"""The environment interface: tasks in, chat prompts out, completions scored.

An environment is three pure functions over JSON-able task dicts, so tasks can be logged,
checkpointed and replayed. Scoring failures never stop a run: `score_safely` turns an exception
into reward 0 and a `failed` flag that the orchestrator counts (`env/failed`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

Task = dict[str, Any]
"""One task: JSON-able, environment-specific (e.g. {"text": "abc", "answer": "cba"})."""

Messages = list[dict[str, str]]
"""OpenAI chat messages: [{"role": "user", "content": "..."}]."""

logger = logging.getLogger(__name__)


class Environment(ABC):
    """Samples tasks, turns a task into chat messages, scores a completion's text."""

    name: str = "env"

    @abstractmethod
    def sample_tasks(self, n: int, rng: np.random.Generator) -> list[Task]:
        """Draw `n` tasks; all randomness comes from `rng` so a restored rng replays the same tasks."""

    @abstractmethod
    def build_prompt(self, task: Task) -> Messages:
        """The chat messages sent to the model for `task`."""

    @abstractmethod
    def score(self, task: Task, completion_text: str) -> float:
        """Reward of one completion (usually in [0, 1]); may raise, see `score_safely`."""


@dataclass(frozen=True)
class Score:
    reward: float
    failed: bool
    error: str | None = None


def score_safely(env: Environment, task: Task, completion_text: str) -> Score:
    """Score one completion; an exception or a non-finite reward counts as a failed rollout with reward 0."""
    try:
        reward = float(env.score(task, completion_text))
    except Exception as e:  # an environment bug must not stop training: count it and go on
        logger.warning("environment %s failed to score a rollout: %s: %s", env.name, type(e).__name__, e)
        return Score(reward=0.0, failed=True, error=f"{type(e).__name__}: {e}")
    if not np.isfinite(reward):
        logger.warning("environment %s returned reward %r; scored as failed (reward 0)", env.name, reward)
        return Score(reward=0.0, failed=True, error=f"non-finite reward {reward!r}")
    return Score(reward=reward, failed=False)
