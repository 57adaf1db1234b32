"""The environment interface: tasks in, chat prompts out, completions scored.

An environment is three pure functions over JSON-able task dicts, so tasks can be logged,
checkpointed and replayed. Scoring failures never stop a run: `score_safely` turns an exception
into reward 0 and a `failed` flag that the orchestrator counts (`env/failed`).

A `MultiTurnEnvironment` also answers each assistant turn (`env_response`: user / tool messages, or
None to stop) and scores the whole conversation; it may declare OpenAI `tools` (a `ToolEnvironment`
executes the model's calls). Multi-turn rollouts run through `multiturn.py`, token-exact.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

Task = dict[str, Any]
"""One task: JSON-able, environment-specific (e.g. {"text": "abc", "answer": "cba"})."""

Messages = list[dict[str, Any]]
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


class MultiTurnEnvironment(Environment):
    """An environment that talks back: after each assistant turn it adds messages, until it says stop."""

    max_turns: int = 4
    """Most assistant turns per rollout; the rollout ends after the last even if the env would go on."""
    tools: list[dict[str, Any]] = []
    """OpenAI tool schemas shown to the model (rendered by the chat template); empty = no tools."""
    tool_call_parser: str = "hermes"
    """How tool calls are written in the sampled text (see tools.py)."""

    @abstractmethod
    def env_response(self, task: Task, messages: Messages, calls: list[Any]) -> Messages | None:
        """Messages answering the last (assistant) message of `messages`, or None when the rollout is over.
        `calls` are the tool calls parsed from that message (`tools.ToolCall`, malformed ones included)."""

    def score_rollout(self, task: Task, messages: Messages) -> float:
        """Reward of a whole conversation; by default `score` of the last assistant message's content."""
        last = next((m for m in reversed(messages) if m["role"] == "assistant"), None)
        return self.score(task, "" if last is None else last.get("content") or "")


def is_multi_turn(env: Environment) -> bool:
    return isinstance(env, MultiTurnEnvironment)


@dataclass(frozen=True)
class Score:
    reward: float
    failed: bool
    error: str | None = None


def score_safely(env: Environment, task: Task, completion_text: str, messages: Messages | None = None) -> Score:
    """Score one completion (or, for a multi-turn env, the conversation `messages`); an exception or a
    non-finite reward counts as a failed rollout with reward 0."""
    try:
        if messages is not None and isinstance(env, MultiTurnEnvironment):
            reward = float(env.score_rollout(task, messages))
        else:
            reward = float(env.score(task, completion_text))
    except Exception as e:  # an environment bug must not stop training: count it and go on
        logger.warning("environment %s failed to score a rollout: %s: %s", env.name, type(e).__name__, e)
        return Score(reward=0.0, failed=True, error=f"{type(e).__name__}: {e}")
    if not np.isfinite(reward):
        logger.warning("environment %s returned reward %r; scored as failed (reward 0)", env.name, reward)
        return Score(reward=0.0, failed=True, error=f"non-finite reward {reward!r}")
    return Score(reward=reward, failed=False)
