"""``[monitor]``: where step metrics go besides ``monitors/file/metrics.jsonl`` (always written)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from prime_rl.common.config.base import BaseConfig


class WandbConfig(BaseConfig):
    """Weights & Biases: metrics, the resolved config and sample tables (`pip install 'prime-rl-common[wandb]'`)."""

    project: str = "prime-rl"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); None uses your default."""
    name: str | None = None
    """Run name shown in W&B; None uses the run directory's name. Each process logs its own W&B run, named
    `<name>-<role>` (trainer, orchestrator) and grouped under `group`."""
    group: str | None = None
    """W&B group that ties the processes of one run together; None uses the run name."""
    tags: list[str] = []
    """W&B tags."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """W&B mode; None follows $WANDB_MODE (online if unset). "offline" writes locally, for `wandb sync` later."""
    dir: Path | None = None
    """Where W&B keeps its local files; None puts them in <run_dir>/monitors/wandb."""
    log_samples: bool = True
    """Log sample tables (prompts, completions, rewards) where a process has them (the orchestrator)."""
    max_samples: int = Field(8, ge=1)
    """Rows per sample table."""
    sample_interval: int = Field(1, ge=1)
    """Log a sample table every this many steps."""


class MonitorConfig(BaseConfig):
    """Step metrics: metrics.jsonl always; Weights & Biases with `[monitor.wandb]`."""

    wandb: WandbConfig | None = None
    """Weights & Biases (`--monitor.wandb` turns it on with defaults); None logs to metrics.jsonl only."""
