"""The watchdog's rule: which process a set of heartbeats says is stalled, and the one-line verdict naming it.

One concept, two callers: the local `prime_rl.launcher.supervisor.Supervisor` and the SLURM job's watchdog
(`prime_rl.launcher.slurm.watchdog`), which imports this module alone (no process-control code).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from prime_rl.common.heartbeat import Beat, last_line, read_beats


def find_stall(
    heartbeat_dir: Path,
    newer_than: float,
    log_of: Callable[[Beat, str], Path | str],
    alive: Callable[[int], bool] | None = None,
    now: float | None = None,
    skip_group: Callable[[str], bool] | None = None,
) -> str | None:
    """The watchdog's verdict: a message naming the process past its phase's deadline, or None.

    One concept, two callers: the local ``Supervisor`` and the SLURM job's watchdog
    (``prime_rl.launcher.slurm.watchdog``). Beats are read from ``heartbeat_dir`` and from its immediate
    subdirectories (a SLURM job gives each step its own, named after the step, because two nodes' inference
    servers both write ``inference-0.json``); the subdirectory name (``group``) is named in the message.
    Beats written before ``newer_than`` belong to an earlier attempt and are ignored.

    ``alive(pid)`` skips an overdue beat whose process has exited (its exit code speaks for it); None where
    pids cannot be checked (SLURM: the process may be on another node). ``log_of(beat, group)`` is the log
    whose last line is quoted when the beat names none. ``skip_group(group)`` leaves a subdirectory out (a SLURM
    job's restartable replicas: their stalls restart them, see `overdue_groups`).

    When several processes are stuck, the most overdue is often a victim: a trainer waiting for a stuck
    orchestrator's batch entered its phase first, so it is overdue first. So among the processes past or near
    (``NEAR_DEADLINE``) their deadlines, one waiting on another stuck process (a phase named in
    ``WAITING_PHASES``, or a component whose ``WAITS_ON`` is stuck itself) is not named while one that waits
    on nobody stuck is: the most overdue of those. Ranks in lockstep cannot be told apart; the most overdue
    is named. The verdict then lists every other stuck process, marking those that wait.
    """
    now = time.time() if now is None else now
    beats: list[tuple[Beat, str]] = []
    directory = Path(heartbeat_dir)
    groups = [""] + sorted(p.name for p in directory.iterdir() if p.is_dir()) if directory.is_dir() else []
    for group in groups:
        if skip_group is not None and skip_group(group):
            continue
        for beat in read_beats(directory / group, newer_than=newer_than):
            if alive is None or alive(beat.pid):
                beats.append((beat, group))
    if not any(b.overdue_s(now) > 0 for b, _ in beats):
        return None

    def used(b: Beat) -> float:  # the fraction of its deadline spent in its phase
        return (now - b.since) / b.deadline_s if b.deadline_s > 0 else float("inf")

    stuck = sorted((item for item in beats if used(item[0]) >= NEAR_DEADLINE), key=lambda i: -i[0].overdue_s(now))
    working = {b.component for b, _ in stuck if not b.phase.startswith(WAITING_PHASES)}

    def waits_on(b: Beat) -> str | None:  # the stuck component this one waits on, if any
        if b.phase.startswith(WAITING_PHASES):
            return "another process"
        return WAITS_ON.get(b.component) if WAITS_ON.get(b.component) in working else None

    named = next((item for item in stuck if waits_on(item[0]) is None), stuck[0])  # all wait: the most overdue
    beat, group = named
    log_path = beat.log or str(log_of(beat, group))
    step = "" if beat.step is None else f" at step {beat.step}"
    where = f", {group}" if group else ""
    reason = (
        f"watchdog: {beat.component} rank {beat.rank} (pid {beat.pid}{where}) stalled in phase '{beat.phase}'{step} "
        f"for {now - beat.since:.0f}s (deadline {beat.deadline_s:.0f}s); last log line: "
        f"{last_line(log_path) or '(none)'} [{log_path}]"
    )

    others = sorted((b for b in stuck if b is not named), key=lambda b: (waits_on(b[0]) is not None, -used(b[0])))
    if others:
        listed = [
            f"{b.component} rank {b.rank}{f' ({g})' if g else ''} in '{b.phase}' for {now - b.since:.0f}s "
            f"(deadline {b.deadline_s:.0f}s{f', waiting on {w}' if (w := waits_on(b)) else ''})"
            for b, g in others[:MAX_LISTED]
        ]
        more = f" and {len(others) - MAX_LISTED} more" if len(others) > MAX_LISTED else ""
        reason += f"; near or past their deadlines too: {', '.join(listed)}{more}"
    return reason


def overdue_beat(directory: Path, newer_than: float, now: float | None = None) -> Beat | None:
    """The most overdue beat in ``directory`` (one SLURM step's heartbeats), or None when none is past its deadline:
    the rule by which one restartable step is wedged, without the job-wide naming of `find_stall`."""
    now = time.time() if now is None else now
    overdue = [b for b in read_beats(directory, newer_than=newer_than) if b.overdue_s(now) > 0]
    return max(overdue, key=lambda b: b.overdue_s(now), default=None)


NEAR_DEADLINE = 0.8
"""Fraction of its deadline a process must have spent in its phase to be listed beside the one named."""
WAITING_PHASES = ("waiting", "paused")
"""Phase prefixes that say the process waits on another (the orchestrator's 'waiting for policy')."""
WAITS_ON = {"trainer": "orchestrator", "orchestrator": "inference"}
"""Whom a component's working phase waits on: the trainer's 'step' begins by taking the orchestrator's batch,
the orchestrator's 'rollouts' wait on the inference servers (a reward it computes itself waits on nobody)."""
MAX_LISTED = 8
"""At most this many other processes in a verdict (a thousand ranks in lockstep are one line, not a page)."""
