"""Incremental reader for one run's `monitors/file/metrics.jsonl`.

The file is append-only and written while we read it, so each poll reads only the bytes past the
last complete line (`offset`). A trailing fragment without a newline is a line still being written:
it is left unread and reported as `partial_line`, then picked up whole on a later poll. A complete
line that is not a JSON object with an integer `step` is skipped and counted (`skipped_lines`),
never raised. A file that shrank (rotated or rewritten) is read again from the start and `epoch`
is bumped, so clients know to drop what they had.

Left out on purpose: `prime_rl.common.monitor.read_metrics` reads a whole file at once; a live
dashboard polling many runs every second needs the byte-offset reader here instead.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# One poll reads at most this many bytes per file, so a huge backlog cannot stall the server.
MAX_READ_BYTES = 8 * 1024 * 1024


def flatten_metrics(obj: dict[str, Any], prefix: str = "", nonfinite: list[str] | None = None) -> dict[str, float]:
    """Numeric leaves of `obj` keyed by slash-joined path; non-numbers (and NaN/inf) are dropped.

    Flat keys such as `loss/mean` pass through; nested dicts become `a/b` so either writer style plots.
    NaN/inf cannot travel as JSON to the page, so their keys are collected in `nonfinite` instead.
    """
    out: dict[str, float] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_metrics(value, prefix=f"{name}/", nonfinite=nonfinite))
        elif isinstance(value, bool):  # bool is an int subclass; a flag is not a curve
            continue
        elif isinstance(value, (int, float)):
            if math.isfinite(value):
                out[name] = float(value)
            elif nonfinite is not None:
                nonfinite.append(name)
    return out


def parse_metrics_line(raw: bytes, nonfinite: list[str] | None = None) -> dict[str, float] | None:
    """One complete line -> `{"step": s, key: value, ...}`, or None if it is malformed.

    Keys whose value is NaN or inf are left out of the row and appended to `nonfinite`.
    """
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(obj, dict):
        return None
    step = obj.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        return None
    row = flatten_metrics({k: v for k, v in obj.items() if k != "step"}, nonfinite=nonfinite)
    row["step"] = step
    return row


@dataclass
class MetricsTail:
    """Rows of one metrics file, grown by `poll()`; all counters describe what was seen so far."""

    path: Path
    rows: list[dict[str, float]] = field(default_factory=list)
    keys: set[str] = field(default_factory=set)
    latest: dict[str, float] = field(default_factory=dict)
    """Last value seen for each key (a key missing from later rows keeps its last value; may be NaN)."""
    nonfinite: dict[str, int] = field(default_factory=dict)
    """Keys that were NaN/inf -> the last step they were (a diverged loss must be visible)."""
    offset: int = 0
    skipped_lines: int = 0
    partial_line: bool = False
    epoch: int = 0
    mtime: float | None = None

    def poll(self) -> int:
        """Read newly appended complete lines; return how many rows were added (0 if none or no file)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self.partial_line = False
            return 0
        self.mtime = st.st_mtime
        if st.st_size < self.offset:
            self._reset()
        if st.st_size == self.offset:
            return 0
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read(min(st.st_size - self.offset, MAX_READ_BYTES))
        end = chunk.rfind(b"\n")
        # Bytes after the last newline belong to a line the writer has not finished yet.
        self.partial_line = end != len(chunk) - 1
        if end < 0:
            return 0
        added = 0
        for raw in chunk[: end + 1].splitlines():
            if not raw.strip():
                continue
            bad: list[str] = []
            row = parse_metrics_line(raw, nonfinite=bad)
            if row is None:
                self.skipped_lines += 1
                continue
            self.rows.append(row)
            self.keys.update(k for k in row if k != "step")
            self.latest.update(row)
            for key in bad:
                self.nonfinite[key] = int(row["step"])
                self.latest[key] = math.nan  # the newest value wins, even when it is NaN
            added += 1
        self.offset += end + 1
        return added

    def _reset(self) -> None:
        self.rows = []
        self.keys = set()
        self.latest = {}
        self.nonfinite = {}
        self.offset = 0
        self.skipped_lines = 0
        self.partial_line = False
        self.epoch += 1
