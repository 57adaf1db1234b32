"""Derive a run's state (running / finished / failed / stale) from files it leaves behind.

The rule, first match wins:

1. A status file written by the launcher (`write_status`): `logs/latest/STATUS` (or
   `logs/latest/status.json`, `STATUS`, `status.json` in the run dir) holding JSON
   `{"state": "running|finished|failed", "reason": "..."}` or just the word. The launcher knows
   best (it saw the exit codes), so this overrides everything below.
2. failed   - a log (`logs/latest/*.log`, `logs/latest/trainer/torchrun/*.log`) contains a Python
   traceback, the word ERROR standing alone (a log level: ` ERROR `, `[ERROR]`, `ERROR:`), or a
   non-zero exit marker (`exit code 3`, `exited with code 1`, `exitcode: 1`, `returncode=1`,
   torchrun's `ChildFailedError`).
3. finished - a log says the run finished (`finished training`, `training finished`,
   `run finished`, `run completed`, ...).
4. running  - the metrics file, a log, or (before either exists) the run folder changed within
   the last `stale_after_s` seconds.
5. stale    - nothing written for longer than that and no end marker: the processes most likely
   died without a word (killed, node lost) - or the run is simply very slow between steps.

Logs are scanned incrementally (byte offset per file), so a long log is read once.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

STATES = ("running", "finished", "failed", "stale")
STATUS_FILES = ("logs/latest/STATUS", "logs/latest/status.json", "STATUS", "status.json")

FAILED_RE = re.compile(
    rb"Traceback \(most recent call last\)"
    rb"|(?:^|[\s\[|])ERROR(?:[\]\s:|]|$)"
    rb"|exit(?:ed)?(?: with)?\s+(?:code|status)\s*[:=]?\s*-?[1-9]"
    rb"|(?:exit|return)\s?code\s*[:=]\s*-?[1-9]"
    rb"|ChildFailedError",
    re.MULTILINE,
)
FINISHED_RE = re.compile(
    rb"(?i)\b(?:finished|completed|done)\s+(?:training|the run|run)\b"
    rb"|\b(?:training|run|rl run|sft run)\s+(?:has\s+)?(?:finished|completed|complete|done)\b",
)
EXCEPTION_LINE_RE = re.compile(rb"^[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b.*$", re.MULTILINE)
MAX_SCAN_BYTES = 4 * 1024 * 1024


def read_status(run_dir: Path) -> tuple[str, str] | None:
    """(state, detail) from the launcher's status file, or None if there is none (or it is unusable)."""
    for rel in STATUS_FILES:
        path = run_dir / rel
        try:
            text = path.read_text().strip()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, UnicodeDecodeError):
            continue
        detail = ""
        try:
            obj = json.loads(text)
        except ValueError:
            obj = text
        if isinstance(obj, dict):
            detail = str(obj.get("reason") or obj.get("message") or "")
            if obj.get("state") == "running" and _launcher_gone(obj):
                # SIGKILL (or a lost node) gave the launcher no chance to write a final state.
                return "failed", f"the launcher (pid {obj['pid']} on {obj['host']}) is gone without a final status"
            obj = obj.get("state")
        if isinstance(obj, str) and obj.strip().lower() in STATES:
            return obj.strip().lower(), detail or f"{rel} says so"
    return None


def _launcher_gone(status: dict) -> bool:
    """A "running" status whose launcher process, on this very host, no longer exists.

    The pid alone is not enough: after a SIGKILL (or a reboot) another process may carry it, so a status
    that records the launcher's start time (``pid_start``) is gone once that pid started at another time.
    """
    pid, host = status.get("pid"), status.get("host")
    if not isinstance(pid, int) or host != socket.gethostname():
        return False  # written elsewhere (SLURM): this machine cannot tell
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    started = status.get("pid_start")
    return isinstance(started, int) and process_start(pid) not in (None, started)


def process_start(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22); None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rfind(b")") + 2 :].split()[19])  # field 2 (the command) may hold spaces


def settle_dead_status(path: Path) -> str | None:
    """Rewrite a "running" STATUS file (``logs/attempt_<n>/STATUS``) whose launcher is gone as "failed".

    ``rl`` calls it on the previous attempt before starting the next, so that attempt reads dead to every
    reader, not only to those that check the launcher's pid. Returns the reason written, None if untouched.
    """
    try:
        status = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(status, dict) or status.get("state") != "running" or not _launcher_gone(status):
        return None
    reason = (
        f"the launcher (pid {status['pid']} on {status['host']}) died without a final status "
        "(SIGKILL, OOM killer or a lost node)"
    )
    tmp = Path(path).with_name(f".STATUS.{os.getpid()}")
    tmp.write_text(json.dumps({**status, "state": "failed", "reason": reason, "settled": time.time()}) + "\n")
    os.replace(tmp, path)
    return reason


def read_status_file(run_dir: Path) -> str | None:
    """Only the state from `read_status` (None without a usable status file)."""
    found = read_status(run_dir)
    return None if found is None else found[0]


def write_status(run_dir: Path, state: str, reason: str = "", **extra: object) -> Path:
    """Write `logs/latest/STATUS` for the dashboard, atomically (a reader never sees half a file).

    For the launcher: call with "running" after starting the processes, then "finished" or
    "failed" (with `reason`, e.g. "trainer exited with code 1") when the job ends.
    """
    if state not in STATES:
        raise ValueError(f"state={state!r} is not one of {STATES}; pick one of those")
    if isinstance(pid := extra.get("pid"), int) and extra.get("host") == socket.gethostname():
        extra.setdefault("pid_start", process_start(pid))  # a reused pid is not mistaken for the launcher
    path = Path(run_dir) / STATUS_FILES[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".STATUS.{os.getpid()}")
    tmp.write_text(json.dumps({"state": state, "reason": reason, "time": time.time(), **extra}) + "\n")
    os.replace(tmp, path)
    return path


def log_files(run_dir: Path) -> list[Path]:
    """The logs the status rule reads (the latest attempt only)."""
    latest = run_dir / "logs" / "latest"
    return sorted(latest.glob("*.log")) + sorted((latest / "trainer" / "torchrun").glob("*.log"))


@dataclass
class _LogScan:
    offset: int = 0
    failed: bool = False
    finished: bool = False
    first_error: str | None = None


@dataclass
class StatusTracker:
    """Keeps per-log scan offsets for one run so each `state()` call reads only new log bytes."""

    run_dir: Path
    stale_after_s: float = 300.0
    _scans: dict[Path, _LogScan] = field(default_factory=dict)
    reason: str = ""

    def state(self, metrics_mtime: float | None, now: float | None = None) -> str:
        now = time.time() if now is None else now
        explicit = read_status(self.run_dir)
        if explicit is not None:
            state, self.reason = explicit
            return state
        # A run with nothing written yet counts from when its folder last changed.
        last_write = metrics_mtime or file_mtime(self.run_dir) or 0.0
        failed: _LogScan | None = None
        finished = False
        for path in log_files(self.run_dir):
            scan = self._scan(path)
            try:
                last_write = max(last_write, path.stat().st_mtime)
            except FileNotFoundError:
                continue
            if scan.failed and failed is None:
                failed = scan
                self.reason = f"{path.relative_to(self.run_dir)}: {scan.first_error}"
            finished = finished or scan.finished
        if failed is not None:
            return "failed"
        if finished:
            self.reason = "log says finished"
            return "finished"
        if last_write and now - last_write <= self.stale_after_s:
            self.reason = "recent writes"
            return "running"
        self.reason = f"no writes for over {self.stale_after_s:.0f}s"
        return "stale"

    def _scan(self, path: Path) -> _LogScan:
        scan = self._scans.setdefault(path, _LogScan())
        try:
            size = path.stat().st_size
            if size < scan.offset:  # truncated or replaced: start over
                scan = self._scans[path] = _LogScan()
            if size == scan.offset:
                return scan
            with open(path, "rb") as f:
                f.seek(scan.offset)
                chunk = f.read(min(size - scan.offset, MAX_SCAN_BYTES))
        except (FileNotFoundError, IsADirectoryError):
            return scan
        end = chunk.rfind(b"\n")
        if end < 0 and len(chunk) < MAX_SCAN_BYTES:
            return scan  # only an unfinished line so far
        text = chunk[: end + 1] if end >= 0 else chunk
        scan.offset += len(text)
        if not scan.failed and (m := FAILED_RE.search(text)):
            scan.failed = True
            line_start = text.rfind(b"\n", 0, m.start()) + 1
            line_end = text.find(b"\n", m.start())
            line = text[line_start : line_end if line_end >= 0 else None]
            if m.group().startswith(b"Traceback") and line_end >= 0:
                # The exception itself ("RuntimeError: ...") is the first unindented line after the frames.
                if exc := EXCEPTION_LINE_RE.search(text, line_end + 1):
                    line = exc.group()
            scan.first_error = line.decode(errors="replace").strip()[:200]
        scan.finished = scan.finished or FINISHED_RE.search(text) is not None
        return scan


def file_mtime(path: Path) -> float | None:
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:
        return None


def main(argv: list[str] | None = None) -> None:
    """``python -m prime_rl.launcher.dashboard.status RUN_DIR STATE [REASON]``: for job scripts (SLURM)."""
    import argparse
    import socket as _socket

    parser = argparse.ArgumentParser(prog="python -m prime_rl.launcher.dashboard.status")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("state", choices=STATES)
    parser.add_argument("reason", nargs="?", default="")
    parser.add_argument("--pid", type=int, default=None, help="the job script's pid (recorded with the host)")
    args = parser.parse_args(argv)
    extra = {} if args.pid is None else {"pid": args.pid, "host": _socket.gethostname()}
    write_status(args.run_dir, args.state, reason=args.reason, **extra)


if __name__ == "__main__":
    main()
