"""Builders for fake run directories in the layout DESIGN.md describes (shared by the dashboard tests)."""

from __future__ import annotations

import json
from pathlib import Path


def make_run(root: Path, rel: str, steps: int = 0, logs: dict[str, str] | None = None) -> Path:
    """A run dir at root/rel with `steps` metric lines and `logs` (path under logs/latest -> text)."""
    run = root / rel
    (run / "monitors" / "file").mkdir(parents=True)
    attempt = run / "logs" / "attempt_0"
    attempt.mkdir(parents=True)
    (run / "logs" / "latest").symlink_to("attempt_0")
    for name, text in (logs or {}).items():
        path = attempt / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for step in range(1, steps + 1):
        append_metrics(run, {"step": step, "reward/mean": step / 10, "loss/mean": 1.0 / step})
    return run


def append_metrics(run: Path, metrics: dict, raw: str | None = None) -> None:
    """Append one JSON line (or `raw` text as is) to the run's metrics file."""
    with open(run / "monitors" / "file" / "metrics.jsonl", "a") as f:
        f.write(raw if raw is not None else json.dumps(metrics) + "\n")
