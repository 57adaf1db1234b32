"""One dead replica behind the router is restarted while the others serve (`inference.max_restarts`, replicas > 1).

Without this, the replica supervisor (`prime_rl.inference.router`) ended the whole `inference` process when any
replica died, so the launcher restarted every replica (or stopped the run). Now, within the budget
(`prime_rl.common.restarts.RestartPolicy`: `max_restarts` within `restart_window`):

1. the dead replica is taken out of the router (vllm-router's ``POST /remove_worker?url=``), so no request is
   routed to it while it is down; the router and the other replicas keep serving;
2. it is started again with the same command (its process group stopped first);
3. it is put back (``POST /add_worker?url=``) only once its HTTP health answers and its control plane reports the
   weight version the other replicas serve (`prime_rl.common.readmission`, the rule the SLURM job uses too): a
   restarted replica serves the model's own weights until the orchestrator reloads the current policy into it
   (`prime_rl.orchestrator.heal`), and a request routed to it before would be tagged with a version it does not
   serve.

A restart that dies, or is not back within ``router.startup_timeout``, or a death with no restart left, ends the
process naming every cause (the launcher then handles the inference component as a whole). Each step is logged
with its origin (exit code or signal, time). The router's admin routes are its own (unauthenticated): it listens
where the deployment puts it, loopback by default.

Left out: the orphans of a SIGKILLed replica (vLLM's engine core in a session of its own) are not reaped here; the
launcher, a child subreaper, stops them with the run.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prime_rl.common.heartbeat import read_beats
from prime_rl.common.readmission import readmission_version, router_worker
from prime_rl.common.restarts import RestartPolicy, clock, describe_exit

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    number: int
    deadline: float
    died_at: float
    cause: str


class ReplicaRestarts:
    """Watches the replica processes; restarts a dead one and re-admits it to the router once it serves the policy."""

    def __init__(
        self,
        urls: list[str],
        router_url: str,
        spawn: Callable[[int], subprocess.Popen],
        policy: RestartPolicy,
        *,
        startup_timeout_s: float,
        healthy: Callable[[int], bool],
        version: Callable[[int], int | None],
        beats: Callable[[int], Path | None] = lambda i: None,
    ) -> None:
        self.urls, self.router_url, self.spawn, self.policy = urls, router_url, spawn, policy
        self.startup_timeout_s = startup_timeout_s
        self.healthy, self.version, self.beats = healthy, version, beats
        self.pending: dict[int, _Pending] = {}
        self.reason = ""

    def check(self, replicas: list[subprocess.Popen]) -> int | None:
        """One pass over the replicas (``replicas`` is updated in place); an exit code when the process must end."""
        for i, proc in enumerate(replicas):
            rc = proc.poll()
            if i in self.pending:
                if (verdict := self._check_restart(i, proc, rc)) is not None:
                    return verdict
            elif rc is not None or (stall := self._stalled(i, proc)) is not None:
                how = f"died ({describe_exit(rc)})" if rc is not None else stall
                cause = f"replica {i} (pid {proc.pid}) {how} at {clock(time.time())}"
                if not self.policy.allows(time.time()):
                    return self._fail(self.policy.exhausted_reason(cause, time.time()))
                replicas[i] = self._restart(i, proc, cause)
        return None

    def _stalled(self, i: int, proc: subprocess.Popen) -> str | None:
        """How replica ``i`` is stuck while alive (a heartbeat of its process group past its deadline: its engine
        errored, a wedged engine core), or None. What the launcher does for a single server, per replica."""
        directory = self.beats(i)
        if directory is None:
            return None
        now = time.time()
        for beat in read_beats(directory):
            if beat.overdue_s(now) > 0 and _in_group(beat.pid, proc.pid):
                return f"stalled in phase '{beat.phase}' for {now - beat.since:.0f}s (deadline {beat.deadline_s:.0f}s)"
        return None

    def _restart(self, i: int, proc: subprocess.Popen, cause: str) -> subprocess.Popen:
        number = self.policy.record(time.time(), cause)
        removed = self._router("remove", i)
        logger.warning(
            "%s; %s the router; restarting it (restart %d/%d within inference.restart_window=%.0fs)",
            cause, "removed from" if removed else "could not remove it from", number, self.policy.max_restarts,
            self.policy.window_s,
        )  # fmt: skip
        _stop_group(proc)
        if (directory := self.beats(i)) is not None:
            shutil.rmtree(directory, ignore_errors=True)  # the old process's last beat is no verdict on the new one
        fresh = self.spawn(i)
        self.pending[i] = _Pending(number, time.monotonic() + self.startup_timeout_s, time.time(), cause)
        return fresh

    def _check_restart(self, i: int, proc: subprocess.Popen, rc: int | None) -> int | None:
        pending = self.pending[i]
        if rc is not None:
            return self._fail(
                self.policy.died_restarting_reason(
                    pending.number, f"died during start-up ({describe_exit(rc)})", pending.cause
                )
            )
        served = readmission_version(i, len(self.urls), self.pending, self.healthy, self.version)
        if served is not None:
            if self._router("add", i):
                del self.pending[i]
                logger.warning(
                    "replica %d (pid %d) is back after restart %d/%d, serving weight version %d (%.0fs after it "
                    "died): re-admitted to the router",
                    i, proc.pid, pending.number, self.policy.max_restarts, served, time.time() - pending.died_at,
                )  # fmt: skip
            return None
        if time.monotonic() > pending.deadline:
            during = f"was not back serving the others' weights after {self.startup_timeout_s:.0f}s"
            return self._fail(self.policy.died_restarting_reason(pending.number, during, pending.cause))
        return None

    def _router(self, action: str, i: int) -> bool:
        if (error := router_worker(self.router_url, action, self.urls[i])) is not None:
            logger.error("router %s_worker %s %s", action, self.urls[i], error)
        return error is None

    def _fail(self, reason: str) -> int:
        logger.error("%s; stopping every replica", reason)
        self.reason = reason
        return 1


def _in_group(pid: int, group: int) -> bool:
    """Whether ``pid`` is alive in process group ``group`` (a replica and the engine core it started)."""
    try:
        return os.getpgid(pid) == group
    except (ProcessLookupError, PermissionError):
        return False


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of a dead replica's process group (its API server may have left children behind)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
