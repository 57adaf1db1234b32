"""All runs under one root: discovery, incremental metrics, status, and the JSON the page polls.

The page polls `snapshot(since)` with what it already holds per run (`epoch`, row count) and gets
back the table for every run plus only the rows it lacks, capped per response so a long run's
backlog arrives over a few polls instead of one huge reply.
"""

from __future__ import annotations

import fnmatch
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prime_rl.launcher.dashboard.discovery import METRICS_RELPATH, find_run_dirs, run_name
from prime_rl.launcher.dashboard.metrics_tail import MetricsTail
from prime_rl.launcher.dashboard.status import StatusTracker

# Table columns: label -> metric keys to try in order; a trailing "/" means "first key with this prefix", a
# "*" matches one key segment (fnmatch): "eval/*/reward_mean" is the online eval of the first environment.
KEY_FIGURES: dict[str, tuple[str, ...]] = {
    "reward": ("reward/mean", "reward"),
    "eval reward": ("eval/*/reward_mean",),
    "loss": ("loss/mean", "loss", "loss/"),
    "throughput": ("perf/throughput",),
    "MFU": ("perf/mfu",),
    "peak memory": ("perf/peak_memory",),
    "mismatch KL": ("mismatch_kl", "mismatch_kl/mean"),
    "step time": ("time/step",),
}
MAX_ROWS_PER_RUN = 5000


def pick_figure(latest: dict[str, float], candidates: tuple[str, ...]) -> tuple[str, float] | None:
    """The first candidate key present in `latest` (prefix candidates end in "/"), with its value."""
    for cand in candidates:
        if "*" in cand:
            for key in sorted(latest):
                if fnmatch.fnmatchcase(key, cand) and key.count("/") == cand.count("/"):
                    return key, latest[key]
        elif cand.endswith("/"):
            for key in sorted(latest):
                if key.startswith(cand):
                    return key, latest[key]
        elif cand in latest:
            return cand, latest[cand]
    return None


@dataclass
class Run:
    run_dir: Path
    name: str
    tail: MetricsTail
    status: StatusTracker


class RunRegistry:
    """Thread-safe view of every run under `root`; cheap to call on every HTTP poll."""

    def __init__(self, root: Path, stale_after_s: float = 300.0, rescan_interval_s: float = 2.0):
        self.root = Path(root)
        self.stale_after_s = stale_after_s
        self.rescan_interval_s = rescan_interval_s
        self._runs: dict[str, Run] = {}
        self._last_scan = float("-inf")
        self._lock = threading.Lock()

    def refresh(self) -> None:
        """Re-discover runs (at most every `rescan_interval_s`) and read new metric lines."""
        now = time.monotonic()
        if now - self._last_scan >= self.rescan_interval_s:
            self._last_scan = now
            found = find_run_dirs(self.root)
            names = {run_name(d, self.root) for d in found}
            for gone in set(self._runs) - names:  # folder deleted or moved away
                del self._runs[gone]
            for run_dir in found:
                name = run_name(run_dir, self.root)
                if name not in self._runs:
                    self._runs[name] = Run(
                        run_dir=run_dir,
                        name=name,
                        tail=MetricsTail(run_dir / METRICS_RELPATH),
                        status=StatusTracker(run_dir, stale_after_s=self.stale_after_s),
                    )
        for run in self._runs.values():
            run.tail.poll()

    def snapshot(self, since: dict[str, Any] | None = None) -> dict[str, Any]:
        """Refresh, then describe every run; include rows past `since[name] = [epoch, count]`."""
        since = since or {}
        with self._lock:
            self.refresh()
            runs = [self._describe(run, since.get(run.name)) for run in self._runs.values()]
            keys = sorted(set().union(*(run.tail.keys for run in self._runs.values())))
        return {"root": str(self.root), "keys": keys, "runs": sorted(runs, key=lambda r: r["name"])}

    def _describe(self, run: Run, have: Any) -> dict[str, Any]:
        tail = run.tail
        state = run.status.state(tail.mtime)
        start = 0
        if isinstance(have, (list, tuple)) and len(have) == 2 and have[0] == tail.epoch:
            start = max(0, min(int(have[1]), len(tail.rows)))
        rows = tail.rows[start : start + MAX_ROWS_PER_RUN]
        figures = {}
        for label, candidates in KEY_FIGURES.items():
            hit = pick_figure(tail.latest, candidates)
            if hit is None:
                figures[label] = None
            else:  # NaN/inf is not JSON: send null and say why
                key, value = hit
                finite = math.isfinite(value)
                figures[label] = {"key": key, "value": value if finite else None, "nonfinite": not finite}
        return {
            "name": run.name,
            "path": str(run.run_dir),
            "state": state,
            "reason": run.status.reason,
            "has_metrics_file": tail.path.exists(),
            "num_rows": len(tail.rows),
            "latest_step": int(tail.rows[-1]["step"]) if tail.rows else None,
            "skipped_lines": tail.skipped_lines,
            "partial_line": tail.partial_line,
            "nonfinite": tail.nonfinite,
            "figures": figures,
            "epoch": tail.epoch,
            "start": start,
            "rows": rows,
            "more": start + len(rows) < len(tail.rows),
        }
