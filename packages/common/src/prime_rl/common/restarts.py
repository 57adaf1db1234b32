"""When a supervisor may restart a dead process, and how it says what happened.

Two supervisors use it, hence common: the launcher's (the inference server as a whole) and the replica
supervisor of `prime_rl.inference.router` (one replica behind the router, the others serving on).

Design:
- A budget, not a counter: at most ``max_restarts`` restarts within any ``window_s`` seconds. A server that
  dies once a day for a week keeps running; one that dies every minute stops the run after the budget, naming
  its last deaths instead of restarting forever. ``max_restarts = 0`` is the old behaviour: the first death
  stops the run.
- Every death is described by its origin (exit code or signal, and the wall-clock time) so that the run's
  final reason tells the whole story: "inference died (SIGKILL) at 05:01:02; restart 1/1 died during
  start-up (exit 1)".
- Pure bookkeeping (no processes, no clock of its own): the supervisor passes the time in, tests do too.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from dataclasses import dataclass, field


def describe_exit(rc: int) -> str:
    """'exit 1' or 'SIGKILL' from a Popen return code (negative: killed by that signal)."""
    if rc >= 0:
        return f"exit {rc}"
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def clock(at: float) -> str:
    """HH:MM:SS of a time.time() value, local time (what the launcher's log lines show)."""
    return time.strftime("%H:%M:%S", time.localtime(at))


@dataclass
class RestartPolicy:
    """At most ``max_restarts`` restarts within any ``window_s`` seconds."""

    max_restarts: int
    window_s: float
    _times: deque[float] = field(default_factory=deque)
    causes: list[str] = field(default_factory=list)
    """Every death that led to a restart, oldest first (for the final reason)."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts} must be >= 0; use 0 to never restart")
        if self.window_s <= 0:
            raise ValueError(f"restart_window={self.window_s} must be > 0 seconds; e.g. 3600")

    def in_window(self, now: float) -> int:
        """Restarts counted at ``now`` (those older than the window are forgotten)."""
        while self._times and self._times[0] <= now - self.window_s:
            self._times.popleft()
        return len(self._times)

    def allows(self, now: float) -> bool:
        return self.in_window(now) < self.max_restarts

    def record(self, now: float, cause: str) -> int:
        """Count a restart at ``now``; returns its number within the window (1-based)."""
        self._times.append(now)
        self.causes.append(cause)
        return self.in_window(now)

    def exhausted_reason(self, cause: str, now: float) -> str:
        """The run's final reason when ``cause`` finds no restart left."""
        if self.max_restarts == 0:
            return cause
        used = self.in_window(now)
        return (
            f"{cause}; no restart left ({used}/{self.max_restarts} used within inference.restart_window="
            f"{self.window_s:.0f}s; earlier: {'; '.join(self.causes[-used:])})"
        )

    def died_restarting_reason(self, number: int, during: str, cause: str | None = None) -> str:
        """The run's final reason when restart ``number`` itself failed (``during``: e.g. 'died during start-up
        (exit 1)'); ``cause``: the death it followed, when not the last one recorded (several replicas)."""
        return f"{cause or self.causes[-1]}; restart {number}/{self.max_restarts} {during}"
