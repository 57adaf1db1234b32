"""Environments: where tasks come from and how completions are scored."""

from prime_rl.orchestrator.envs.base import Environment, Messages, Score, Task, score_safely
from prime_rl.orchestrator.envs.registry import build_environment

__all__ = ["Environment", "Messages", "Score", "Task", "build_environment", "score_safely"]
