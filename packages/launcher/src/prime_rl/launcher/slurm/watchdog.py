"""``python -m prime_rl.launcher.slurm.watchdog HEARTBEAT_DIR LOG_DIR REASON_FILE``: the SLURM job's watchdog.

The job script (on the batch node, the allocation's first) starts this beside its components. Every
process of the job writes its heartbeat to the shared run directory, one subdirectory per job step
(``heartbeats/<step name>/<component>-<rank>.json``, see base.sbatch.j2); once a second this reads them
all with the local launcher's rule (``prime_rl.launcher.stall.find_stall``). When one is past its
phase's deadline it writes the verdict (component, rank, step, phase, last log line) to ``REASON_FILE``,
prints it and exits ``STALL_EXIT_CODE``; the job script then stops every step, writes the run's STATUS
with that reason and exits 1.

Design decisions:
- The same verdict as a single-node run: one function decides, two supervisors act on it.
- No pid check: a beat's process may live on another node, where this one cannot look. A process that
  exited is caught by the job script first (its step ends within a second, long before a deadline).
- Clocks: a beat's times are the writer's clock, compared with this node's; cluster nodes keep them in
  step (NTP), and deadlines are seconds to minutes, so skew below a second does not matter.
- It exits on its own when the job script is gone (its parent changes), so it never outlives a job.
- Restartable steps (``--restartable inference-node``, with ``inference.max_restarts > 0``): a stall in one of
  them is not the job's end but that step's. The watchdog writes the step's verdict to ``--wedged-dir/<step>``
  and goes on watching the others; the job script stops the step, whose exit then takes the restart path a
  death takes (the local launcher restarts a wedged replica the same way, `Supervisor._stalled`). The step is
  left out while its marker exists; the job script removes the marker (and the step's old beats) when it
  starts the step again.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from prime_rl.common.heartbeat import Beat
from prime_rl.launcher.stall import find_stall, overdue_beat

STALL_EXIT_CODE = 3
"""Exit code for "a process stalled" (the verdict is in REASON_FILE); any other non-zero exit is a crash."""


def log_of(log_dir: Path, trainer_log_dir: Path | None) -> Callable[[Beat, str], Path]:
    """Where a beat's last log line is read: a trainer rank's own log, else its job step's log."""

    def resolve(beat: Beat, group: str) -> Path:
        if beat.component == "trainer" and trainer_log_dir is not None:
            rank_log = trainer_log_dir / f"{beat.rank}.log"
            if rank_log.is_file():
                return rank_log
        return log_dir / f"{group or beat.component}.log"

    return resolve


def write_atomic(path: Path, verdict: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(verdict + "\n")
    os.replace(tmp, path)  # the job script never reads half a verdict


def mark_wedged(
    heartbeat_dir: Path,
    wedged_dir: Path,
    restarts: Callable[[str], bool],
    since: float,
    resolve: Callable[[Beat, str], Path],
) -> None:
    """Write the verdict of each restartable step with a beat past its deadline and no marker yet."""
    if not heartbeat_dir.is_dir():
        return
    for step in sorted(p.name for p in heartbeat_dir.iterdir() if p.is_dir() and restarts(p.name)):
        marker = wedged_dir / step
        if marker.exists() or overdue_beat(heartbeat_dir / step, since) is None:
            continue  # being restarted, or well
        verdict = find_stall(heartbeat_dir, since, resolve, skip_group=lambda group, step=step: group != step)
        if verdict is None:  # its beat was replaced since
            continue
        wedged_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(marker, verdict)
        print(f"{verdict}; {step} is restartable: the job script stops it", file=sys.stderr, flush=True)


def watch(
    heartbeat_dir: Path,
    log_dir: Path,
    reason_file: Path,
    trainer_log_dir: Path | None = None,
    interval_s: float = 1.0,
    since: float | None = None,
    restartable: tuple[str, ...] = (),
    wedged_dir: Path | None = None,
) -> int:
    """Poll until a process stalls (write the verdict, return STALL_EXIT_CODE) or the job script is gone (0).

    Beats written before ``since`` (unix time; default now) belong to an earlier job of the same run. A stall in a
    step whose name starts with one of ``restartable`` is written to ``wedged_dir/<step>`` instead (see above)."""
    started_at = time.time() if since is None else since
    parent = os.getppid()
    resolve = log_of(log_dir, trainer_log_dir)

    def restarts(group: str) -> bool:
        return wedged_dir is not None and bool(restartable) and group.startswith(restartable)

    while os.getppid() == parent:
        if wedged_dir is not None:
            mark_wedged(heartbeat_dir, wedged_dir, restarts, started_at, resolve)
        verdict = find_stall(heartbeat_dir, started_at, resolve, skip_group=restarts)
        if verdict is not None:
            write_atomic(reason_file, verdict)
            print(verdict, file=sys.stderr, flush=True)
            return STALL_EXIT_CODE
        time.sleep(interval_s)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m prime_rl.launcher.slurm.watchdog", description=__doc__.split("\n")[0]
    )
    parser.add_argument("heartbeat_dir", type=Path, help="the run's heartbeats/ (one subdirectory per job step)")
    parser.add_argument("log_dir", type=Path, help="launcher/logs: <step name>.log for each job step")
    parser.add_argument("reason_file", type=Path, help="where the verdict is written when a process stalls")
    parser.add_argument("--trainer-log-dir", type=Path, default=None, help="logs/attempt_<n>/trainer/torchrun")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between two reads of the heartbeats")
    parser.add_argument("--since", type=float, default=None, help="unix time the job started (default: now)")
    parser.add_argument(
        "--restartable", action="append", default=[], help="a step-name prefix whose stall restarts the step"
    )
    parser.add_argument("--wedged-dir", type=Path, default=None, help="where a restartable step's verdict is written")
    args = parser.parse_args(argv)
    if bool(args.restartable) != (args.wedged_dir is not None):
        parser.error("--restartable and --wedged-dir go together")
    return watch(
        args.heartbeat_dir, args.log_dir, args.reason_file, args.trainer_log_dir, args.interval, args.since,
        tuple(args.restartable), args.wedged_dir,
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
