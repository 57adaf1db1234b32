"""Run a set of local processes as one job: start them, echo one of them, stop all when one fails.

Design:
- Each component runs in its own session (process group), so stopping it reaches everything it
  spawned (torchrun's ranks, vLLM's engine processes) with one ``killpg``.
- Each child also gets PR_SET_PDEATHSIG: if the launcher itself is killed with SIGKILL, the direct
  children get SIGTERM and take their own children down, so no orphans are left behind.
- The launcher is a child subreaper (PR_SET_CHILD_SUBREAPER): a process whose parent dies is adopted
  by the launcher instead of init. torchrun starts each rank in a session of its own, so when the
  torchrun agent is SIGKILLed its ranks are beyond the agent's process group; as the launcher's
  adoptees they are still found (by walking /proc) and stopped with everything else.
- Watchdog: with ``heartbeat_dir`` set, every process's heartbeat (``prime_rl.common.heartbeat``) is
  read once a second; a process past the deadline of its phase stops the job, naming component, rank,
  phase, step and the last line of its log. A hang ends in seconds instead of never.
- Shared memory: vLLM's engine processes talk through POSIX shared memory (``/dev/shm/psm_*``, 160-250
  MB each); a SIGKILLed engine never unlinks it. After stopping everything, segments that appeared
  during the job and that no live process still maps or holds open are removed.
- A component that exits non-zero fails the job: the message names it and its log file. A
  component marked ``finishes_run`` that exits 0 ends the job successfully; the others are stopped.
- Ctrl-C (SIGINT) or SIGTERM to the launcher stops every component and exits 130 / 143.
- Restarts: a component with ``max_restarts > 0`` (the inference server, `inference.max_restarts`) that exits,
  whose heartbeat is past its deadline (a wedged engine core: the watchdog's verdict for any other component),
  or whose ``alive`` probe fails for ``unhealthy_after_s``, is stopped whole (its process group, and the orphans
  the launcher adopted from it: vLLM's engine core), its shared memory released, and started again with the
  same argv and environment while the others keep running; the supervisor waits for ``ready`` again without
  blocking (a trainer that finishes meanwhile still ends the run). The budget is ``RestartPolicy``
  (``restarts.py``); a restart that dies or is not ready in ``ready_timeout_s``, or a death with no restart
  left, stops the run naming every cause.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prime_rl.common.heartbeat import read_beats
from prime_rl.common.restarts import RestartPolicy, clock, describe_exit
from prime_rl.launcher.stall import find_stall

log = logging.getLogger("prime_rl.launcher")

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _set_subreaper(on: bool) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)
    except OSError:
        pass  # not Linux: orphans of a killed torchrun agent go to init


def _proc_stats() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, /proc/<pid>/stat fields from the state on) of every process; nothing where /proc is absent.

    Fields 3, 4, 5 of stat(5) (state, parent pid, process group) come out as [0], [1], [2]: field 2 (the
    command) may hold spaces, so the line is split after its ")"."""
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        yield int(entry), stat[stat.rfind(b")") + 2 :].split()


def _children_map() -> dict[int, list[int]]:
    """Parent pid -> child pids of every live process, from /proc; empty where /proc is absent."""
    children: dict[int, list[int]] = {}
    for pid, fields in _proc_stats():
        children.setdefault(int(fields[1]), []).append(pid)
    return children


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children first), from /proc; empty where /proc is absent."""
    children = _children_map()
    found, frontier = [], [root]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return found


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (of any of its threads)."""
    return _children_map().get(pid, [])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: fall back to the launcher's own cleanup


@dataclass
class Component:
    name: str
    cmd: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    finishes_run: bool = False
    """Exit code 0 of this component means the whole job is done."""
    echo: bool = False
    """Copy this component's output to the launcher's console."""
    ready: Callable[[], bool] | None = None
    """If set, the next component starts only once this returns True (e.g. a health check)."""
    ready_timeout_s: float = 600.0
    """How long ``ready`` may take before the job fails."""
    max_restarts: int = 0
    """Restarts within ``restart_window_s`` when the process dies (0: its death fails the job)."""
    restart_window_s: float = 3600.0
    alive: Callable[[], bool] | None = None
    """Liveness probe of a restartable component once ready (e.g. HTTP /health); failing for
    ``unhealthy_after_s`` counts as a death."""
    unhealthy_after_s: float = 60.0


@dataclass
class _Running:
    component: Component
    proc: subprocess.Popen
    log_file: object
    echo_pos: int = 0
    was_ready: bool = False
    """Its ``ready`` answered once (a component that never came up is not restarted: its config is at fault)."""
    restarting: int = 0
    """Number of the restart in progress (waiting for ``ready``); 0 when none."""
    restart_deadline: float = 0.0
    died_at: float = 0.0
    unhealthy_since: float | None = None
    last_probe: float = 0.0
    last_watch: float = 0.0


class JobFailed(RuntimeError):
    pass


class Supervisor:
    def __init__(
        self,
        components: list[Component],
        poll_s: float = 0.2,
        stop_timeout_s: float = 15.0,
        heartbeat_dir: Path | None = None,
        watch_interval_s: float = 1.0,
        on_restart: Callable[[str, int], None] | None = None,
    ):
        self.components = components
        self.poll_s = poll_s
        self.stop_timeout_s = stop_timeout_s
        self.heartbeat_dir = heartbeat_dir
        self.watch_interval_s = watch_interval_s
        self._started_at = time.time()
        self._last_watch = 0.0
        self.running: list[_Running] = []
        self.reason = ""
        """Why the job ended when it did not succeed (names the component), for the run's STATUS."""
        self._signal: int | None = None
        self.on_restart = on_restart
        """Called with (event, restarts so far) at each restart and recovery (the launcher updates STATUS)."""
        self.restarts: dict[str, RestartPolicy] = {
            c.name: RestartPolicy(c.max_restarts, c.restart_window_s) for c in components if c.max_restarts > 0
        }
        self.num_restarts = 0
        self._shm_before: set[str] = set()
        self._foreign: set[int] = set()
        """Children the host process had before the job started (a test's wandb service, multiprocessing's
        resource tracker): not the job's, so never stopped with it, nor anything below them."""

    # ------------------------------------------------------------------ lifecycle
    def start(self, comp: Component) -> None:
        self.running.append(self._spawn(comp))

    def _spawn(self, comp: Component) -> _Running:
        comp.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(comp.log_path, "ab", buffering=0)
        proc = subprocess.Popen(
            comp.cmd,
            env={**os.environ, **comp.env, "PYTHONUNBUFFERED": "1"},  # unbuffered: the log shows output as it comes
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        log.info("started %s (pid %d), log: %s", comp.name, proc.pid, comp.log_path)
        return _Running(comp, proc, log_file)

    def run(self) -> int:
        """Start everything, wait for the job to end, stop what is left; return the exit code."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        self._foreign = set(_children(os.getpid()))
        _set_subreaper(True)
        shm_before = self._shm_before = shm_segments()
        self._started_at = time.time()  # heartbeats older than this belong to an earlier attempt
        try:
            for comp in self.components:
                self.start(comp)
                self.running[-1].was_ready = comp.ready is None
                if comp.ready is not None and (rc := self._wait_ready(comp)) is not None:
                    return rc
            return self._wait()
        finally:
            self.stop()
            for name in release_shm(shm_segments() - shm_before):
                log.info("removed shared memory /dev/shm/%s left by a stopped process", name)
            _set_subreaper(False)  # a process that runs a Supervisor in-process (tests) adopts nothing later
            for s, handler in old.items():
                signal.signal(s, handler)

    def _on_signal(self, signum: int, _frame) -> None:
        self._signal = signum

    def _check(self) -> int | None:
        """The job's exit code if it ended (signal, failure, a finishing component), else None."""
        self._echo()
        if self._signal is not None:
            log.warning("received %s: stopping all processes", signal.Signals(self._signal).name)
            self.reason = f"stopped by {signal.Signals(self._signal).name}"
            return 128 + self._signal
        for r in list(self.running):
            rc = r.proc.poll()
            if r.component.name in self.restarts and (r.was_ready or r.restarting):
                if (verdict := self._check_restartable(r, rc)) is not None:
                    return verdict
                continue
            if rc is None:
                continue
            if rc != 0:
                self._echo()
                log.error(
                    "process '%s' exited with code %d; stopping all. See its log: %s",
                    r.component.name,
                    rc,
                    r.component.log_path,
                )
                self._print_tail(r.component.log_path)
                self.reason = f"{r.component.name} exited with code {rc}; see {r.component.log_path}"
                return 1
            if r.component.finishes_run:
                self._echo()
                log.info("process '%s' finished; stopping the others", r.component.name)
                return 0
        return self._watch()

    # ------------------------------------------------------------------ restarts
    def _check_restartable(self, r: _Running, rc: int | None) -> int | None:
        """A restartable component: restart it when it died (or lost health), finish a restart once ready; 1 when
        the job must stop (the reason names every cause)."""
        comp, policy, now = r.component, self.restarts[r.component.name], time.time()
        if r.restarting:
            if rc is not None:
                return self._fail(
                    r, policy.died_restarting_reason(r.restarting, f"died during start-up ({describe_exit(rc)})")
                )
            if time.monotonic() - r.last_probe < max(self.poll_s, 0.5):
                return None
            r.last_probe = time.monotonic()
            if comp.ready is not None and not comp.ready():
                if time.monotonic() > r.restart_deadline:
                    during = f"was not ready after {comp.ready_timeout_s:.0f}s"
                    return self._fail(r, policy.died_restarting_reason(r.restarting, during))
                return None
            event = (
                f"{comp.name} is back after restart {r.restarting}/{comp.max_restarts} ({now - r.died_at:.0f}s after "
                f"it died; pid {r.proc.pid})"
            )
            log.warning("%s", event)
            r.restarting, r.was_ready = 0, True
            self._notify(event)
            return None
        if rc is None:
            lost = self._stalled(r, now) or self._lost_health(r, now)
            if lost is None:
                return None
            cause = lost
        else:
            cause = f"{comp.name} died ({describe_exit(rc)}) at {clock(now)}"
        if not policy.allows(now):
            return self._fail(r, policy.exhausted_reason(cause, now))
        self._restart(r, cause, policy.record(now, cause), now)
        return None

    def _healing_pids(self) -> set[int]:
        """Processes of the serving restartable components (ready, not restarting) and their descendants."""
        pids: set[int] = set()
        for r in self.running:
            if r.component.name in self.restarts and r.was_ready and not r.restarting:
                pids.add(r.proc.pid)
                pids.update(descendants(r.proc.pid))
        return pids

    def _stalled(self, r: _Running, now: float) -> str | None:
        """The cause when a heartbeat of a live restartable component is past its deadline (a wedged engine core,
        a pause never resumed): what stops the job for any other component restarts this one."""
        if self.heartbeat_dir is None or time.monotonic() - r.last_watch < self.watch_interval_s:
            return None
        r.last_watch = time.monotonic()
        mine = {r.proc.pid, *descendants(r.proc.pid)}
        for beat in read_beats(self.heartbeat_dir, newer_than=self._started_at):
            if beat.component == r.component.name and beat.pid in mine and beat.overdue_s(now) > 0:
                return (
                    f"{r.component.name} (pid {beat.pid}) stalled in phase '{beat.phase}' for {now - beat.since:.0f}s "
                    f"(deadline {beat.deadline_s:.0f}s) at {clock(now)}"
                )
        return None

    def _lost_health(self, r: _Running, now: float) -> str | None:
        """The cause when a live restartable component's ``alive`` probe has failed for ``unhealthy_after_s``."""
        comp = r.component
        if comp.alive is None or time.monotonic() - r.last_probe < 5.0:
            return None
        r.last_probe = time.monotonic()
        if comp.alive():
            r.unhealthy_since = None
            return None
        r.unhealthy_since = r.unhealthy_since or now
        if now - r.unhealthy_since < comp.unhealthy_after_s:
            return None
        return (
            f"{comp.name} (pid {r.proc.pid}) failed its health check for {now - r.unhealthy_since:.0f}s at {clock(now)}"
        )

    def _fail(self, r: _Running, reason: str) -> int:
        self._echo()
        log.error("%s; stopping all. See its log: %s", reason, r.component.log_path)
        self._print_tail(r.component.log_path)
        self.reason = f"{reason}; see {r.component.log_path}"
        return 1

    def _restart(self, r: _Running, cause: str, number: int, now: float) -> None:
        """Stop what is left of ``r`` (its group, adopted orphans, their shared memory) and start it again."""
        comp = r.component
        log.warning(
            "%s; restarting it (restart %d/%d within inference.restart_window=%.0fs). See its log: %s",
            cause, number, comp.max_restarts, comp.restart_window_s, comp.log_path,
        )  # fmt: skip
        self._print_tail(comp.log_path)
        self._stop_one(r)
        for name in release_shm(shm_segments() - self._shm_before):
            log.info("removed shared memory /dev/shm/%s left by the dead %s", name, comp.name)
        with open(comp.log_path, "ab") as f:  # the new process appends to the same log: mark where it begins
            f.write(f"\n===== [launcher] {cause}; restart {number}/{comp.max_restarts} =====\n".encode())
        fresh = self._spawn(comp)
        fresh.restarting, fresh.died_at = number, now
        fresh.restart_deadline = time.monotonic() + comp.ready_timeout_s
        fresh.echo_pos = r.echo_pos
        self.running[self.running.index(r)] = fresh
        self.num_restarts += 1
        self._notify(f"restarting {comp.name} (restart {number}/{comp.max_restarts}): {cause}")

    def _stop_one(self, r: _Running) -> None:
        """SIGTERM, then SIGKILL, ``r``'s process group and the orphans the launcher adopted from it (children of
        the launcher that are no component's process: a dead vLLM API server's engine core in its own session)."""
        others = {x.proc.pid for x in self.running}
        foreign = set(self._foreign)
        for pid in self._foreign:
            foreign.update(descendants(pid))
        orphans = [pid for pid in _children(os.getpid()) if pid not in others and pid not in foreign]
        strays = set(orphans) | {d for pid in orphans for d in descendants(pid)}
        for sig in (signal.SIGTERM, signal.SIGCONT):
            _killpg(r.proc.pid, sig)
            for pid in strays:
                _kill(pid, sig)
        try:
            r.proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("process '%s' ignored SIGTERM; killing it", r.component.name)
        _killpg(r.proc.pid, signal.SIGKILL)  # the leader may be gone while its group lives on (engine core)
        try:
            r.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            log.error("process '%s' (pid %d) could not be killed", r.component.name, r.proc.pid)
        r.log_file.close()
        self._kill_strays(strays, everything=False)
        deadline = time.monotonic() + 5.0  # group members die asynchronously: wait until none is left
        while _group_alive(r.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _notify(self, event: str) -> None:
        if self.on_restart is not None:
            try:
                self.on_restart(event, self.num_restarts)
            except Exception:  # STATUS is a report: failing to write it must not stop the run
                log.exception("could not report the restart")

    def _watch(self) -> int | None:
        """1 if a heartbeat is past its deadline (the job is stopped, the culprit named), else None."""
        if self.heartbeat_dir is None or time.monotonic() - self._last_watch < self.watch_interval_s:
            return None
        self._last_watch = time.monotonic()
        healing = self._healing_pids()  # a restartable component's stall restarts it (_stalled), not the job
        verdict = find_stall(
            self.heartbeat_dir,
            self._started_at,
            lambda beat, _group: self._log_of(beat.component),
            alive=lambda pid: _alive(pid) and pid not in healing,
        )
        if verdict is None:
            return None
        self.reason = verdict
        log.error("%s; stopping all", self.reason)
        return 1

    def _log_of(self, name: str) -> Path | str:
        for r in self.running:
            if r.component.name == name:
                return r.component.log_path
        return ""

    def _wait(self) -> int:
        while (rc := self._check()) is None:
            time.sleep(self.poll_s)
        return rc

    def _wait_ready(self, comp: Component) -> int | None:
        deadline = time.monotonic() + comp.ready_timeout_s
        while (rc := self._check()) is None:
            if comp.ready():
                log.info("%s is ready", comp.name)
                for r in self.running:
                    r.was_ready = r.was_ready or r.component is comp
                return None
            if time.monotonic() > deadline:
                log.error(
                    "process '%s' was not ready after %.0fs; stopping all. See its log: %s",
                    comp.name,
                    comp.ready_timeout_s,
                    comp.log_path,
                )
                self._print_tail(comp.log_path)
                self.reason = f"{comp.name} was not ready after {comp.ready_timeout_s:.0f}s; see {comp.log_path}"
                return 1
            time.sleep(max(self.poll_s, 0.5))
        return rc

    def stop(self) -> None:
        """SIGTERM every process group still alive, then SIGKILL what outlives the timeout.

        Processes that left their component's group (torchrun ranks run in sessions of their own) are
        found among the launcher's descendants and get the same treatment.
        """
        strays = self._ours() - {r.proc.pid for r in self.running}
        alive = [r for r in self.running if r.proc.poll() is None]
        for r in alive:
            _killpg(r.proc.pid, signal.SIGTERM)
            _killpg(r.proc.pid, signal.SIGCONT)  # a stopped (SIGSTOP) process handles SIGTERM only once continued
        for pid in strays:
            _kill(pid, signal.SIGTERM)
            _kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + self.stop_timeout_s
        for r in alive:
            try:
                r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("process '%s' ignored SIGTERM; killing it", r.component.name)
        # The leader may be gone while its group lives on (e.g. vLLM's engine core): kill the groups.
        for r in self.running:
            _killpg(r.proc.pid, signal.SIGKILL)
            try:
                r.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("process '%s' (pid %d) could not be killed", r.component.name, r.proc.pid)
            r.log_file.close()
        self._kill_strays(strays)

    def _ours(self) -> set[int]:
        """The launcher's descendants that belong to the job: its components' trees and the orphans it adopted
        (a SIGKILLed torchrun agent's ranks), not what the host process ran before the job."""
        foreign = set(self._foreign)
        for pid in self._foreign:
            foreign.update(descendants(pid))
        return set(descendants(os.getpid())) - foreign

    def _kill_strays(self, strays: set[int], everything: bool = True) -> None:
        deadline = time.monotonic() + self.stop_timeout_s
        while strays and time.monotonic() < deadline:
            _reap(strays)  # adopted orphans only: their exit status is nobody's
            strays = {pid for pid in strays if _alive(pid)}
            time.sleep(0.05)
        for pid in strays | (self._ours() if everything else set()):
            log.warning("killing leftover process %d", pid)
            _kill(pid, signal.SIGKILL)
        _reap(strays)

    # ------------------------------------------------------------------ console
    def _echo(self) -> None:
        for r in self.running:
            if not r.component.echo:
                continue
            try:
                with open(r.component.log_path, "rb") as f:
                    f.seek(r.echo_pos)
                    chunk = f.read()
            except FileNotFoundError:
                continue
            end = chunk.rfind(b"\n") + 1  # whole lines only
            if end:
                sys.stdout.write(chunk[:end].decode(errors="replace"))
                sys.stdout.flush()
                r.echo_pos += end

    @staticmethod
    def _print_tail(path: Path, lines: int = 20) -> None:
        try:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
        except FileNotFoundError:
            return
        sys.stderr.write(f"--- last {len(tail)} lines of {path} ---\n" + "\n".join(tail) + "\n")


SHM_DIR = Path("/dev/shm")
SHM_PREFIXES = ("psm_",)
"""multiprocessing.shared_memory segments (what vLLM's engine processes create, 160-250 MB each).

Not multiprocessing's named semaphores (``sem.mp-*``, 32 bytes each): a process that another job is
starting at that moment holds its semaphore by name only until the spawned child reopens it, so
"no live process maps it" does not mean it is free; removing one broke a concurrent vLLM start
(``SemLock._rebuild: FileNotFoundError``)."""


def shm_segments() -> set[str]:
    try:
        return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(SHM_PREFIXES)}
    except OSError:
        return set()


def _shm_in_use() -> set[str]:
    """Names under /dev/shm that some live process maps or holds open."""
    used: set[str] = set()
    prefix = str(SHM_DIR) + "/"
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                used.update(line.split(prefix, 1)[1].split()[0] for line in f if prefix in line)
            for fd in os.listdir(f"/proc/{entry}/fd"):
                target = os.readlink(f"/proc/{entry}/fd/{fd}")
                if target.startswith(prefix):
                    used.add(target[len(prefix) :].split()[0])
        except OSError:
            continue
    return used


def release_shm(candidates: set[str]) -> list[str]:
    """Unlink the ``candidates`` no live process uses; return those removed."""
    if not candidates:
        return []
    in_use = _shm_in_use()
    removed = []
    for name in sorted(candidates - in_use):
        try:
            (SHM_DIR / name).unlink()
            removed.append(name)
        except OSError:
            pass
    return removed


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    """Running (not a zombie). Never reaps: a component's own exit status belongs to its Popen."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"Z"


def _reap(pids: set[int]) -> None:
    """Collect exited adoptees (only these pids: never a component's own Popen, whose status it needs)."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def _group_alive(pgid: int) -> bool:
    """A live (not zombie) process is still in group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return any(int(fields[2]) == pgid and fields[0] != b"Z" for _, fields in _proc_stats())


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
