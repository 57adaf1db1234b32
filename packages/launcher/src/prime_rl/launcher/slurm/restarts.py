"""``python -m prime_rl.launcher.slurm.restarts died|readmit ...``: inference restarts in an ``rl`` SLURM job.

The job script (rl.sbatch.j2 with ``inference.max_restarts > 0``; one replica per inference node behind the
vllm-router on the first) owns the ``srun`` steps; this module decides and probes for it:

- ``died``: an ``inference-node<i>`` step ended. Within the budget (`prime_rl.common.restarts.RestartPolicy`:
  ``max_restarts`` within ``restart_window``, the local launcher's rule) it records the death with its origin
  (exit status or signal, node, time), takes the replica's URL out of the router, updates STATUS (``restarts``,
  ``last_restart``; the state stays ``running``), prints the event and exits 0: the script starts the step again.
  Otherwise it prints the job's final reason naming every cause and exits 1: no restart left, or the replica was
  still in its restart ("restart 1/2 died during start-up").
- ``readmit``: started by the script beside the restarted step; polls until the replica may serve again
  (`prime_rl.common.readmission`: HTTP health, and the weight version the other replicas serve on its control
  plane, which the orchestrator reloads into it, `prime_rl.orchestrator.heal`), puts it back into the router and
  exits 0; not back within ``router.startup_timeout``, it writes the final reason to ``--reason-file`` and exits 1.

Design decisions:
- The budget is kept in a JSON file beside the job's exit code (``launcher/job_<id>.restarts.json``, under an
  flock: two replicas may die at once) and replayed into a ``RestartPolicy`` at each call, so the window's rule is
  the one the local launcher applies, not a bash copy of it.
- Each call is a short process on the batch node, like the watchdog: nothing to keep alive between deaths.
- A wedged replica (alive, a heartbeat past its deadline) is restarted like a dead one: the job's watchdog marks
  it (`prime_rl.launcher.slurm.watchdog`, ``--restartable``), the job script stops its step and calls ``died``
  with ``--stalled VERDICT``, which becomes the cause in place of the exit status.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prime_rl.common.readmission import control_version, http_healthy, readmission_version, router_worker
from prime_rl.common.restarts import RestartPolicy, clock, describe_exit
from prime_rl.launcher.dashboard.status import STATUS_FILES, write_status


def describe_status(code: int) -> str:
    """A step's exit status as bash reports it ('exit 1'; above 128, killed by signal status - 128: 'SIGKILL')."""
    return describe_exit(128 - code) if code > 128 else describe_exit(code)


@contextmanager
def locked_state(path: Path, write: bool = True) -> Iterator[dict[str, Any]]:
    """The job's restart record, read (and written back unless ``write`` is False) under the record's lock."""
    with open(path.with_name(f"{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if write else fcntl.LOCK_SH)
        state = json.loads(path.read_text()) if path.exists() else {"deaths": [], "restarting": {}}
        yield state
        if write:
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(state) + "\n")
            os.replace(tmp, path)


def replay(args: argparse.Namespace, deaths: list[list]) -> RestartPolicy:
    """The budget with every recorded restart counted at its time (those out of the window drop out)."""
    policy = RestartPolicy(args.max_restarts, args.window)
    for at, cause in deaths:
        policy.record(at, cause)
    return policy


def report(args: argparse.Namespace, event: str, restarts: int) -> None:
    """Into the run's STATUS (state still running, the job script's pid and host kept), as the local launcher does."""
    if args.status_run_dir is None:
        return
    try:
        current = json.loads((args.status_run_dir / STATUS_FILES[0]).read_text())
        kept = {k: v for k, v in current.items() if k not in ("state", "reason", "time", "restarts", "last_restart")}
        write_status(args.status_run_dir, "running", **kept, restarts=restarts, last_restart=event)
    except (OSError, ValueError, AttributeError) as e:  # STATUS is a report: failing to write it stops nothing
        print(f"could not update STATUS: {e}", file=sys.stderr)


def died(args: argparse.Namespace) -> int:
    now, how = time.time(), describe_status(args.code)
    cause = f"{args.name} on {args.node} died ({how}) at {clock(now)}"
    during = f"died during start-up ({how})"
    if args.stalled:  # the watchdog's verdict on a live step, stopped by the job script: that is why it ended
        stall = args.stalled.strip().removeprefix("watchdog: ")
        cause = f"{args.name} on {args.node} was stopped at {clock(now)}: {stall}"
        during = f"was stopped during start-up: {stall}"
    with locked_state(args.state) as state:
        policy = replay(args, state["deaths"])
        restarting = state["restarting"].get(str(args.replica))
        if restarting is not None:
            print(policy.died_restarting_reason(restarting["number"], during, restarting["cause"]))
            return 1
        if not policy.allows(now):
            print(policy.exhausted_reason(cause, now))
            return 1
        number = policy.record(now, cause)
        state["deaths"].append([now, cause])
        state["restarting"][str(args.replica)] = {"number": number, "died_at": now, "cause": cause}
        total = len(state["deaths"])
    error = router_worker(args.router, "remove", args.worker_url, os.environ.get("VLLM_API_KEY"))
    event = (
        f"{cause}; {'removed from the router' if error is None else f'router remove_worker {error}'}; restarting it "
        f"(restart {number}/{args.max_restarts} within inference.restart_window={args.window:.0f}s)"
    )
    print(event)
    report(args, event, total)
    return 0


def readmit(args: argparse.Namespace) -> int:
    i, urls, controls = args.replica, args.urls, args.controls
    deadline, parent = time.monotonic() + args.timeout, os.getppid()
    while os.getppid() == parent:  # the job script is gone: nothing to report to
        with locked_state(args.state, write=False) as state:  # probed each second: no write
            restarting = {int(k) for k in state["restarting"]}
            entry = state["restarting"][str(i)]
        served = readmission_version(
            i, len(urls), restarting, lambda j: http_healthy(urls[j]), lambda j: control_version(controls[j])
        )
        if served is not None:
            error = router_worker(args.router, "add", urls[i], os.environ.get("VLLM_API_KEY"))
            if error is None:
                with locked_state(args.state) as state:
                    del state["restarting"][str(i)]
                    total = len(state["deaths"])
                event = (
                    f"{args.name} is back after restart {entry['number']}/{args.max_restarts}, serving weight version "
                    f"{served} ({time.time() - entry['died_at']:.0f}s after it died): re-added to the router"
                )
                print(f"job: {event}", flush=True)
                report(args, event, total)
                return 0
            print(f"job: router add_worker {urls[i]} {error}; trying again", file=sys.stderr, flush=True)
        if time.monotonic() > deadline:
            during = f"was not back serving the others' weights after {args.timeout:.0f}s"
            reason = RestartPolicy(args.max_restarts, args.window).died_restarting_reason(
                entry["number"], during, entry["cause"]
            )
            args.reason_file.write_text(reason + "\n")
            print(f"job: {reason}", file=sys.stderr, flush=True)
            return 1
        time.sleep(args.interval)
    return 0


def main(argv: list[str] | None = None) -> int:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--state", type=Path, required=True, help="the job's restart record (JSON)")
    common.add_argument("--name", required=True, help="the step's name, e.g. inference-node1")
    common.add_argument("--replica", type=int, required=True, help="its index among the router's workers")
    common.add_argument("--max-restarts", type=int, required=True, help="inference.max_restarts")
    common.add_argument("--window", type=float, required=True, help="inference.restart_window, seconds")
    common.add_argument("--router", required=True, help="the router's root URL (admin routes)")
    common.add_argument("--status-run-dir", type=Path, default=None, help="the run whose STATUS reports restarts")
    parser = argparse.ArgumentParser(
        prog="python -m prime_rl.launcher.slurm.restarts", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    on_death = commands.add_parser("died", parents=[common], help="a replica's step ended: restart it or not")
    on_death.add_argument("--code", type=int, required=True, help="its exit status as bash reports it")
    on_death.add_argument("--node", required=True, help="the node it ran on")
    on_death.add_argument("--worker-url", required=True, help="its URL in the router")
    on_death.add_argument("--stalled", default="", help="the watchdog's verdict when the script stopped it (wedged)")
    back = commands.add_parser("readmit", parents=[common], help="put a restarted replica back once it serves")
    back.add_argument("--urls", nargs="+", required=True, help="every replica's HTTP root, in the router's order")
    back.add_argument("--controls", nargs="+", required=True, help="every replica's control address, same order")
    back.add_argument("--timeout", type=float, required=True, help="inference.router.startup_timeout, seconds")
    back.add_argument("--reason-file", type=Path, required=True, help="where the final reason goes if it is not back")
    back.add_argument("--interval", type=float, default=1.0, help="seconds between two probes")
    args = parser.parse_args(argv)
    return died(args) if args.command == "died" else readmit(args)


if __name__ == "__main__":
    raise SystemExit(main())
