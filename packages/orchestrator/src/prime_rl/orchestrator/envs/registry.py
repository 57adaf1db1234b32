"""Build the environment a config names (import-guarded optional backends are loaded lazily)."""

from __future__ import annotations

import importlib
from typing import Any

from prime_rl.common.config.orchestrator import (
    ArithmeticEnvConfig,
    EnvConfig,
    PythonEnvConfig,
    ReasoningGymEnvConfig,
    ReverseTextEnvConfig,
    ToolArithmeticEnvConfig,
    VerifiersEnvConfig,
)
from prime_rl.orchestrator.envs.arithmetic import ArithmeticEnv
from prime_rl.orchestrator.envs.base import Environment
from prime_rl.orchestrator.envs.reverse_text import ReverseTextEnv


def load_python_env(entrypoint: str, kwargs: dict[str, Any]) -> Environment:
    """Import `module:attr` and call it with `kwargs`; it must give an `Environment`."""
    module_name, _, attr = entrypoint.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(
            f"env entrypoint={entrypoint!r}: cannot import {module_name!r} ({e}); install the package that "
            "provides it into the orchestrator's environment"
        ) from e
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"env entrypoint={entrypoint!r}: {module_name} has no attribute {attr!r}")
        target = getattr(target, part)
    env = target(**kwargs)
    if not isinstance(env, Environment):
        raise TypeError(
            f"env entrypoint={entrypoint!r} returned a {type(env).__name__}, not a "
            "prime_rl.orchestrator.envs.base.Environment; point it at an Environment subclass or factory"
        )
    return env


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
    if isinstance(config, PythonEnvConfig):
        return load_python_env(config.entrypoint, config.kwargs)
    if isinstance(config, VerifiersEnvConfig):
        from prime_rl.orchestrator.envs.verifiers_env import VerifiersEnv

        return VerifiersEnv(config.id, config.args, config.max_turns, config.max_tasks)
    raise ValueError(f"unknown environment config {type(config).__name__}")
