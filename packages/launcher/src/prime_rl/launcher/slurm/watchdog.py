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
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from prime_rl.common.heartbeat import Beat
from prime_rl.launcher.stall import find_stall

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


def watch(
    heartbeat_dir: Path,
    log_dir: Path,
    reason_file: Path,
    trainer_log_dir: Path | None = None,
    interval_s: float = 1.0,
    since: float | None = None,
) -> int:
    """Poll until a process stalls (write the verdict, return STALL_EXIT_CODE) or the job script is gone (0).

    Beats written before ``since`` (unix time; default now) belong to an earlier job of the same run."""
    started_at = time.time() if since is None else since
    parent = os.getppid()
    resolve = log_of(log_dir, trainer_log_dir)
    while os.getppid() == parent:
        verdict = find_stall(heartbeat_dir, started_at, resolve)
        if verdict is not None:
            tmp = reason_file.with_name(f".{reason_file.name}.tmp")
            tmp.write_text(verdict + "\n")
            os.replace(tmp, reason_file)  # the job script never reads half a verdict
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
    args = parser.parse_args(argv)
    return watch(args.heartbeat_dir, args.log_dir, args.reason_file, args.trainer_log_dir, args.interval, args.since)


if __name__ == "__main__":
    raise SystemExit(main())
