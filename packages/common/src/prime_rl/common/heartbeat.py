"""Heartbeats: each process says what it is doing and for how long that may take; the launcher watches.

A heartbeat is one small JSON file per process, ``<run_dir>/heartbeats/<component>[-<rank>].json``,
replaced atomically on every beat:

    {"component": "trainer", "rank": 1, "pid": 123, "phase": "step", "step": 7,
     "since": <unix time the phase began or last made progress>, "deadline_s": 600, "time": <last write>,
     "log": "<the process's log file>"}

A process is stalled when ``now - since > deadline_s``: it promised to leave the phase (or beat again
with progress) within ``deadline_s`` and did not. The launcher's watchdog
(``prime_rl.launcher.supervisor``) then stops the run, naming the component, rank, phase, step and
the last line of its log: a hang becomes an error in seconds, not a 3600 s timeout or forever.

Design decisions:
- Files, not sockets: nothing to connect or authenticate, survives the process that wrote it (a
  stopped rank still shows where it stopped), readable by a person with ``cat``.
- The deadline travels with the beat: the process knows what its phase waits on and which config
  timeout bounds it (the orchestrator waiting for weights: ``weights_timeout``; a paused server:
  ``weights.max_pause``); the launcher needs no per-component knowledge.
- Beats are cheap and rate-limited (``min_interval_s``) unless the phase or step changes, so calling
  ``beat`` in a hot loop costs a ``time.monotonic()``.
- ``Heartbeat.from_env`` returns a no-op outside a launched run (``PRIME_RL_HEARTBEAT_DIR`` unset),
  so components and tests need no special casing.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prime_rl.common.env import HEARTBEAT_DIR_ENV, STALL_TIMEOUT_ENV

DEFAULT_DEADLINE_S = 3600.0


@dataclass
class Beat:
    component: str
    rank: int
    pid: int
    phase: str
    step: int | None
    since: float
    deadline_s: float
    time: float
    log: str = ""

    def overdue_s(self, now: float | None = None) -> float:
        """Seconds past the deadline (negative while within it)."""
        return (time.time() if now is None else now) - self.since - self.deadline_s


class Heartbeat:
    """Writes one process's heartbeat file."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | None,
        component: str,
        rank: int = 0,
        *,
        default_deadline_s: float = DEFAULT_DEADLINE_S,
        min_interval_s: float = 1.0,
        log: str = "",
    ) -> None:
        self.path = None if directory is None else Path(directory) / f"{component}-{rank}.json"
        """This process's heartbeat file; None makes every beat a no-op."""
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.component, self.rank, self.log = component, rank, log
        """Written into every beat: who beats, and the log the watchdog quotes when it stalls."""
        self.default_deadline_s = default_deadline_s
        """A beat's deadline when it names none."""
        self.min_interval_s = min_interval_s
        """Unchanged beats closer together than this are not written (``beat`` in a hot loop stays cheap)."""
        self._key: tuple | None = None
        self._since = 0.0
        self._last_write = -float("inf")

    @classmethod
    def from_env(cls, component: str, rank: int = 0, log: str = "") -> Heartbeat:
        """A heartbeat into ``$PRIME_RL_HEARTBEAT_DIR`` (a no-op when unset)."""
        deadline = float(os.environ.get(STALL_TIMEOUT_ENV, DEFAULT_DEADLINE_S))
        return cls(os.environ.get(HEARTBEAT_DIR_ENV) or None, component, rank, default_deadline_s=deadline, log=log)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def beat(
        self, phase: str, step: int | None = None, deadline_s: float | None = None, progress: bool = False
    ) -> None:
        """Enter (or stay in) ``phase``; a new phase or step (or ``progress``) restarts its deadline."""
        if self.path is None:
            return
        deadline = self.default_deadline_s if deadline_s is None else deadline_s
        key = (phase, step, deadline)
        now_mono = time.monotonic()
        changed = key != self._key or progress
        if not changed and now_mono - self._last_write < self.min_interval_s:
            return
        now = time.time()
        if changed:
            self._since = now
            self._key = key
        beat = Beat(self.component, self.rank, os.getpid(), phase, step, self._since, deadline, now, self.log)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(asdict(beat)))
            os.replace(tmp, self.path)
        except OSError:
            return  # a heartbeat must never take its process down (e.g. a full disk names itself elsewhere)
        self._last_write = now_mono

    def close(self, phase: str = "exited") -> None:
        """Mark the process done: no deadline (the supervisor watches its exit code instead)."""
        self.beat(phase, deadline_s=float("inf"))


def read_beats(directory: str | os.PathLike[str], newer_than: float = 0.0) -> list[Beat]:
    """Every readable heartbeat in ``directory`` written after ``newer_than`` (unix time)."""
    beats = []
    for path in sorted(Path(directory).glob("*.json")) if Path(directory).is_dir() else []:
        try:
            beat = Beat(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # being replaced right now, or not ours
        if beat.time >= newer_than:
            beats.append(beat)
    return beats


def last_line(path: str | os.PathLike[str], max_bytes: int = 8192) -> str:
    """The last non-empty line of a log file ("" if there is none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            lines = [line for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""
