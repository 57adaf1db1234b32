"""Build the environment a config names (import-guarded optional backends are loaded lazily)."""

from __future__ import annotations

from prime_rl.common.config.orchestrator import (
    ArithmeticEnvConfig,
    EnvConfig,
    ReasoningGymEnvConfig,
    ReverseTextEnvConfig,
    ToolArithmeticEnvConfig,
)
from prime_rl.orchestrator.envs.arithmetic import ArithmeticEnv
from prime_rl.orchestrator.envs.base import Environment
from prime_rl.orchestrator.envs.reverse_text import ReverseTextEnv


def build_environment(config: EnvConfig) -> Environment:
    if isinstance(config, ReverseTextEnvConfig):
        return ReverseTextEnv(config.unit, config.min_len, config.max_len)
    if isinstance(config, ArithmeticEnvConfig):
        return ArithmeticEnv(config.num_terms, config.max_value)
    if isinstance(config, ReasoningGymEnvConfig):
        from prime_rl.orchestrator.envs.reasoning_gym import ReasoningGymEnv

        return ReasoningGymEnv(config.name, config.size, config.seed, **config.kwargs)
    if isinstance(config, ToolArithmeticEnvConfig):
        from prime_rl.orchestrator.envs.tool_arithmetic import ToolArithmeticEnv

        return ToolArithmeticEnv(config.max_value, tuple(config.ops), config.max_turns)
    raise ValueError(f"unknown environment config {type(config).__name__}")
