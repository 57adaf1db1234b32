"""The fields every process's own config has: where its run directory is, how it logs, and a dry run.

`TrainerRunConfig` (sft and the RL trainer), `OrchestratorConfig` and `EvalConfig` build on it; each sets its
own `run_name` default (required for the trainer, "rl", "eval"). `rl` fills all three from one `[run]` and
`output_dir` (`RLConfig`), so a run's processes always agree on the directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from prime_rl.common.config.base import BaseConfig


class RunSectionConfig(BaseConfig):
    """Run directory, log level and dry run of one process's config."""

    output_dir: Path = Path("outputs")
    """Parent of the run directory."""

    run_name: str
    """Run directory name: everything goes to <output_dir>/<run_name>."""

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Console log level (the trainer's rank 0; the orchestrator's log file too)."""

    dry_run: bool = False
    """Write the resolved config to <run_dir>/configs/<process>.toml (trainer, orchestrator, eval) and exit."""

    @property
    def run_dir(self) -> Path:
        return self.output_dir / self.run_name
