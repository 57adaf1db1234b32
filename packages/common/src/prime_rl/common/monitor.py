"""Step metrics as JSON lines: ``monitors/file/metrics.jsonl``, one object per line, ``step`` first.

Design decisions:
- One ``os.write`` per line on an ``O_APPEND`` descriptor: a reader (the dashboard, a test, ``tail -f``)
  sees whole lines or nothing of a line, never a line interleaved with another writer's, and every
  line is on disk (in the page cache) as soon as ``log`` returns.
- Values are what ``json`` can write; numpy / torch scalars are unwrapped with ``.item()``. NaN and
  inf are written as ``NaN`` / ``Infinity`` (what Python's json reads back): a NaN loss must show.
- ``read_metrics`` tolerates a file being written: an unterminated last line is an in-progress write
  and is skipped quietly; any other unreadable line is skipped and reported (logged, and returned by
  ``scan_metrics``) instead of failing the whole read.
- Weights & Biases (``[monitor.wandb]``) is a second sink behind the same ``log`` call: ``build_monitor``
  returns a ``Monitor`` that writes metrics.jsonl and, when configured, a W&B run per process
  (``<name>-<role>``, grouped by run). ``wandb`` is imported only then: it is an optional extra.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prime_rl.common.rundir import RunDir

if TYPE_CHECKING:
    from prime_rl.common.config.monitor import MonitorConfig, WandbConfig

logger = logging.getLogger(__name__)


def _default(value: Any) -> Any:
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item):
        return item()
    raise TypeError(f"metric value {value!r} of type {type(value).__name__} is not JSON-serializable; log a number")


def _metrics_path(target: RunDir | str | os.PathLike[str]) -> Path:
    if isinstance(target, RunDir):
        return target.metrics_path
    path = Path(target)
    return path if path.suffix == ".jsonl" else RunDir(path.parent, path.name).metrics_path


class FileMonitor:
    """Appends ``{"step": n, **metrics}`` lines to a metrics.jsonl.

    ``target``: a ``RunDir``, a path ending in ``.jsonl`` (the file itself), or a run directory root.
    """

    def __init__(self, target: RunDir | str | os.PathLike[str]) -> None:
        self.path = _metrics_path(target)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append one line for ``step``."""
        if self._fd is None:
            raise ValueError(f"FileMonitor({self.path}) is closed")
        if "step" in metrics:
            raise ValueError(f"metrics must not contain 'step' (got {metrics['step']!r}); pass it as the step argument")
        line = json.dumps({"step": int(step), **metrics}, default=_default, separators=(",", ":")) + "\n"
        data = line.encode("utf-8")
        written = os.write(self._fd, data)
        while written < len(data):  # only on a full disk or a signal; keep the line whole if we can
            written += os.write(self._fd, data[written:])

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """Sample tables are for W&B; metrics.jsonl keeps numbers only."""

    def close(self) -> None:
        if getattr(self, "_fd", None) is not None:  # also safe from __del__ after a failed __init__
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> FileMonitor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class WandbMonitor:
    """One W&B run for one process: ``log`` -> ``run.log(metrics, step=step)``; the config at start."""

    def __init__(
        self, config: WandbConfig, run_dir: RunDir, role: str, run_config: Mapping[str, Any] | None = None
    ) -> None:
        try:
            import wandb
        except ImportError:
            raise ImportError("[monitor.wandb] needs the wandb package: pip install 'prime-rl-common[wandb]'") from None
        self._wandb = wandb
        self.config = config
        directory = Path(config.dir) if config.dir is not None else run_dir.root / "monitors" / "wandb"
        directory.mkdir(parents=True, exist_ok=True)
        name = config.name or run_dir.run_name
        self.run = wandb.init(
            project=config.project,
            entity=config.entity,
            name=f"{name}-{role}",
            group=config.group or name,
            job_type=role,
            tags=config.tags or None,
            config=dict(run_config or {}),
            dir=str(directory),
            mode=config.mode,
            reinit="create_new",  # several monitors in one process (tests) are separate runs
        )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log({k: _default(v) if hasattr(v, "item") else v for k, v in metrics.items()}, step=int(step))

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """A table of up to ``max_samples`` rows (columns: the union of the rows' keys, in first-seen order)."""
        if not self.config.log_samples or not samples or step % self.config.sample_interval:
            return
        rows = list(samples)[: self.config.max_samples]
        columns = list(dict.fromkeys(k for row in rows for k in row))
        table = self._wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        self.run.log({"samples": table}, step=int(step))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class Monitor:
    """Every configured sink behind one interface: ``log(step, metrics)``, ``log_samples``, ``close``."""

    def __init__(self, sinks: Sequence[FileMonitor | WandbMonitor]) -> None:
        self.sinks = list(sinks)

    @property
    def path(self) -> Path:
        """metrics.jsonl (where the dashboard reads)."""
        return next(s.path for s in self.sinks if isinstance(s, FileMonitor))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        for sink in self.sinks:
            sink.log_samples(step, samples)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_monitor(
    run_dir: RunDir,
    config: MonitorConfig | None,
    role: str,
    run_config: Mapping[str, Any] | None = None,
) -> Monitor:
    """metrics.jsonl, plus a W&B run when ``config.wandb`` is set (``run_config`` is logged as its config)."""
    sinks: list[FileMonitor | WandbMonitor] = [FileMonitor(run_dir)]
    if config is not None and config.wandb is not None:
        sinks.append(WandbMonitor(config.wandb, run_dir, role, run_config))
    return Monitor(sinks)


@dataclass
class SkippedLine:
    """A line of metrics.jsonl that was not a metrics record."""

    line_number: int
    """1-based."""
    reason: str
    text: str


@dataclass
class MetricsScan:
    """Everything ``scan_metrics`` found."""

    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[SkippedLine] = field(default_factory=list)
    partial_tail: str = ""
    """Bytes after the last newline (a line still being written), decoded; empty when none."""


def _parse_line(text: str) -> dict[str, Any] | str:
    """The record, or why the line is not one."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg} at column {e.colno})"
    if not isinstance(record, dict):
        return f"not a JSON object but {type(record).__name__}"
    if isinstance(record.get("step"), bool) or not isinstance(record.get("step"), int):
        return f"no integer 'step' (got {record.get('step')!r})"
    return record


def parse_metrics(data: bytes, first_line: int = 1) -> MetricsScan:
    """Parse metrics.jsonl content (complete lines; anything after the last newline is the tail)."""
    scan = MetricsScan()
    *lines, tail = data.split(b"\n")
    scan.partial_tail = tail.decode("utf-8", errors="replace")
    for number, raw in enumerate(lines, start=first_line):
        text = raw.decode("utf-8", errors="replace").strip()
        if not text:
            continue
        parsed = _parse_line(text)
        if isinstance(parsed, dict):
            scan.records.append(parsed)
        else:
            scan.skipped.append(SkippedLine(number, parsed, text[:200]))
    return scan


def scan_metrics(path: str | os.PathLike[str]) -> MetricsScan:
    """Read a metrics.jsonl; records plus what was skipped and why."""
    return parse_metrics(Path(path).read_bytes())


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl in file order; malformed lines are logged as warnings and skipped."""
    scan = scan_metrics(path)
    for skipped in scan.skipped:
        logger.warning("%s:%d skipped: %s: %r", path, skipped.line_number, skipped.reason, skipped.text)
    if scan.partial_tail:
        logger.debug("%s: ignoring an unterminated last line (still being written)", path)
    return scan.records
