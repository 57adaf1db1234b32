"""Find run directories anywhere under a root folder.

A run directory is a folder that contains `monitors/` (where `monitors/file/metrics.jsonl` lives or
will live) or `logs/latest` (the launcher creates it before any metric is written). Matching on
either lets a run show up as "no metrics yet" the moment it starts.

The walk never descends into a run directory (checkpoints and broadcasts can hold many thousands
of files) nor into hidden folders, and does not follow symlinked folders, so it cannot loop.
"""

from __future__ import annotations

import os
from pathlib import Path

METRICS_RELPATH = Path("monitors") / "file" / "metrics.jsonl"


def is_run_dir(path: Path) -> bool:
    """True if `path` looks like a prime-rl run directory (see module docstring)."""
    return (path / "monitors").is_dir() or (path / "logs" / "latest").exists()


def find_run_dirs(root: Path) -> list[Path]:
    """Every run directory under `root` (including `root` itself), sorted by path."""
    root = Path(root)
    if not root.is_dir():
        return []
    found: list[Path] = []
    for dirpath, dirnames, _ in os.walk(root, followlinks=False):
        here = Path(dirpath)
        if is_run_dir(here):
            found.append(here)
            dirnames[:] = []  # a run's own subtree holds no further runs worth the walk
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    return sorted(found)


def run_name(run_dir: Path, root: Path) -> str:
    """Display name: the run's path relative to the dashboard root ("." if it is the root)."""
    rel = Path(run_dir).relative_to(root)
    return str(rel) if str(rel) != "." else Path(root).resolve().name
