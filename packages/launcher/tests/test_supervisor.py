"""The local job supervisor: a failing process stops all and is named; no process is left behind."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from prime_rl.launcher.supervisor import Component, Supervisor

# A process that starts a grandchild (like torchrun's ranks or vLLM's engine) and records both pids.
SPAWNER = textwrap.dedent(
    """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[1], "w").write(f"{child.pid}\\n")
    print("spawner ready", flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _wait_for(path: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().endswith("\n")):
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)


@pytest.mark.chaos
def test_failing_process_stops_all_and_is_named(tmp_path, caplog):
    pidfile = tmp_path / "grandchild.pid"
    crash = "import time, os; time.sleep(1.0); print('boom'); os._exit(3)"
    comps = [
        Component("inference", [sys.executable, "-c", SPAWNER, str(pidfile)], tmp_path / "logs" / "inference.log"),
        Component("trainer", [sys.executable, "-c", crash], tmp_path / "logs" / "trainer.log"),
    ]
    sup = Supervisor(comps, stop_timeout_s=5)
    with caplog.at_level(logging.ERROR, logger="prime_rl.launcher"):
        rc = sup.run()
    assert rc == 1
    assert "process 'trainer' exited with code 3" in caplog.text
    assert str(tmp_path / "logs" / "trainer.log") in caplog.text
    _wait_for(pidfile)
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild), "the inference process's child outlived the job"
    assert all(r.proc.poll() is not None for r in sup.running)
    assert "boom" in (tmp_path / "logs" / "trainer.log").read_text()


def test_finishing_process_ends_job_successfully(tmp_path, capsys):
    comps = [
        Component("inference", [sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "inf.log"),
        Component(
            "trainer",
            [sys.executable, "-c", "print('step 1 | loss 1.0'); print('done')"],
            tmp_path / "trainer.log",
            finishes_run=True,
            echo=True,
        ),
    ]
    sup = Supervisor(comps, stop_timeout_s=5)
    assert sup.run() == 0
    assert "step 1 | loss 1.0" in capsys.readouterr().out  # rank-0 progress shown on the console
    assert all(r.proc.poll() is not None for r in sup.running)


def test_processes_the_host_ran_before_the_job_are_not_the_jobs(tmp_path):
    """A process running a Supervisor in-process (a test, a notebook) keeps its other children: they killed a
    test's wandb service and multiprocessing resource tracker in CI (MailboxClosedError in the next test)."""
    pidfile = tmp_path / "host_grandchild.pid"
    host_child = subprocess.Popen([sys.executable, "-c", SPAWNER, str(pidfile)], stdout=subprocess.DEVNULL)
    try:
        _wait_for(pidfile)
        host_grandchild = int(pidfile.read_text())
        job_pidfile = tmp_path / "job_grandchild.pid"
        comps = [
            Component("inference", [sys.executable, "-c", SPAWNER, str(job_pidfile)], tmp_path / "inf.log"),
            Component("trainer", [sys.executable, "-c", "import time; time.sleep(1.0)"], tmp_path / "t.log",
                      finishes_run=True),
        ]  # fmt: skip
        assert Supervisor(comps, stop_timeout_s=5).run() == 0
        _wait_for(job_pidfile)
        deadline = time.monotonic() + 5
        while _alive(int(job_pidfile.read_text())) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(int(job_pidfile.read_text())), "the job's own grandchild outlived it"
        assert host_child.poll() is None and _alive(host_grandchild), "the job stopped the host's processes"
    finally:
        host_child.kill()
        host_child.wait()
        if _alive(host_grandchild):
            os.kill(host_grandchild, signal.SIGKILL)


@pytest.mark.chaos
def test_ctrl_c_stops_everything(tmp_path):
    """SIGINT to a launcher process: it exits 130 and its components (and their children) are gone."""
    pidfile = tmp_path / "grandchild.pid"
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from prime_rl.launcher.supervisor import Component, Supervisor
        comps = [Component("inference", [sys.executable, "-c", {SPAWNER!r}, {str(pidfile)!r}],
                           Path({str(tmp_path)!r}) / "inf.log")]
        sys.exit(Supervisor(comps, stop_timeout_s=5).run())
        """
    )
    launcher = subprocess.Popen([sys.executable, "-c", script])
    _wait_for(pidfile)
    grandchild = int(pidfile.read_text())
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=30) == 130
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


@pytest.mark.chaos
def test_killed_launcher_leaves_no_orphans(tmp_path):
    """Even SIGKILL on the launcher takes its children down (parent-death signal)."""
    pidfile = tmp_path / "grandchild.pid"
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from prime_rl.launcher.supervisor import Component, Supervisor
        comps = [Component("inference", [sys.executable, "-c", {SPAWNER!r}, {str(pidfile)!r}],
                           Path({str(tmp_path)!r}) / "inf.log")]
        sys.exit(Supervisor(comps).run())
        """
    )
    launcher = subprocess.Popen([sys.executable, "-c", script])
    _wait_for(pidfile)
    launcher.kill()
    launcher.wait(timeout=10)
    # the direct child got SIGTERM from the kernel; its own child is reparented but the spawner's
    # default SIGTERM handling ends only the spawner: check the component process itself is gone.
    log_text = (tmp_path / "inf.log").read_text()
    assert "spawner ready" in log_text
    deadline = time.monotonic() + 5
    spawner_gone = False
    while time.monotonic() < deadline:
        out = subprocess.run(["pgrep", "-f", str(pidfile)], capture_output=True, text=True).stdout.split()
        if not out:
            spawner_gone = True
            break
        time.sleep(0.1)
    assert spawner_gone
    grandchild = int(pidfile.read_text())
    if _alive(grandchild):  # a plain script does not forward SIGTERM to its child; torchrun and vLLM do
        os.kill(grandchild, signal.SIGKILL)


# Like torchrun: the rank runs in a session of its own, out of reach of a killpg on the agent.
AGENT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    open(sys.argv[1], "w").write(f"{os.getpid()} {rank.pid}\\n")
    time.sleep(600)
    """
)


@pytest.mark.chaos
def test_sigkilled_torchrun_agent_takes_its_ranks_down(tmp_path):
    """Probe: SIGKILL of the torchrun agent left the rank training after the launcher reported failure."""
    pidfile = tmp_path / "agent.pid"
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from prime_rl.launcher.supervisor import Component, Supervisor
        comps = [Component("trainer", [sys.executable, "-c", {AGENT!r}, {str(pidfile)!r}],
                           Path({str(tmp_path)!r}) / "trainer.log")]
        sup = Supervisor(comps, stop_timeout_s=5)
        rc = sup.run()
        print("REASON", sup.reason, flush=True)
        sys.exit(rc)
        """
    )
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    _wait_for(pidfile)
    agent, rank = map(int, pidfile.read_text().split())
    os.kill(agent, signal.SIGKILL)
    t0 = time.monotonic()
    assert launcher.wait(timeout=20) == 1
    assert time.monotonic() - t0 < 10
    assert "REASON trainer exited with code -9" in launcher.stdout.read()
    deadline = time.monotonic() + 5
    while _alive(rank) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(rank), "the rank outlived its agent and the launcher"


# Like vLLM's engine: a shared-memory segment the resource tracker will not clean up. It writes its pid (its process
# group: components run in sessions of their own) with the segment's name, and exits 7 if nobody kills it: a kill
# that never came fails the test in bounded time (a component's exit 0 would not end the job: it hung CI for 30 min).
SHM_OWNER = textwrap.dedent(
    """
    import os, sys, time
    from multiprocessing import resource_tracker, shared_memory
    shm = shared_memory.SharedMemory(create=True, size=1 << 20)
    resource_tracker.unregister(shm._name, "shared_memory")
    open(sys.argv[1], "w").write(f"{os.getpid()} {shm.name}\\n")
    time.sleep(120)
    sys.exit(7)
    """
)


@pytest.mark.chaos
def test_shared_memory_of_a_killed_engine_is_released(tmp_path):
    """Probe: each SIGKILL of the inference server leaked vLLM shared-memory segments."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("needs /dev/shm")
    namefile = tmp_path / "shm.name"
    comps = [Component("inference", [sys.executable, "-c", SHM_OWNER, str(namefile)], tmp_path / "inf.log")]
    sup = Supervisor(comps, poll_s=0.05)

    def kill_engine():
        # the pid from the file, not sup.running: the engine can write it before start() has recorded it
        _wait_for(namefile, timeout=100)
        os.killpg(int(namefile.read_text().split()[0]), signal.SIGKILL)

    thread = threading.Thread(target=kill_engine)
    thread.start()
    assert sup.run() == 1
    thread.join()
    assert "inference exited with code -9" in sup.reason, sup.reason  # killed, not timed out
    name = namefile.read_text().split()[1]
    assert not (Path("/dev/shm") / name).exists(), f"/dev/shm/{name} leaked"


# A rank that beats, logs, then stops dead (SIGSTOP: no exit code, no progress: a hang).
STUCK_RANK = textwrap.dedent(
    """
    import os, signal, sys
    from prime_rl.common.heartbeat import Heartbeat
    hb = Heartbeat(sys.argv[1], "trainer", rank=1, log=sys.argv[2])
    hb.beat("step", 7, deadline_s=1.0)
    with open(sys.argv[2], "a") as f:
        f.write("all_reduce of bucket 3 started\\n")
    os.kill(os.getpid(), signal.SIGSTOP)
    """
)


@pytest.mark.chaos
def test_watchdog_stops_a_stuck_rank_in_seconds_naming_it(tmp_path, caplog):
    """Probe: a stuck rank hung the run forever (exits only after 1800-3600 s timeouts)."""
    beats, rank_log = tmp_path / "heartbeats", tmp_path / "1.log"
    comps = [
        Component("trainer", [sys.executable, "-c", STUCK_RANK, str(beats), str(rank_log)], tmp_path / "t.log"),
        Component("orchestrator", [sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "o.log"),
    ]
    sup = Supervisor(comps, poll_s=0.05, heartbeat_dir=beats, watch_interval_s=0.2, stop_timeout_s=5)
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="prime_rl.launcher"):
        assert sup.run() == 1
    assert time.monotonic() - t0 < 15
    assert "watchdog: trainer rank 1" in sup.reason and "phase 'step' at step 7" in sup.reason
    assert "last log line: all_reduce of bucket 3 started" in sup.reason and str(rank_log) in sup.reason
    assert "stalled" in caplog.text
    assert all(r.proc.poll() is not None for r in sup.running)  # the stopped rank was killed too


def test_watchdog_ignores_beats_within_their_deadline_and_from_earlier_attempts(tmp_path):
    from prime_rl.common.heartbeat import Heartbeat

    beats = tmp_path / "heartbeats"
    Heartbeat(beats, "trainer", rank=0).beat("step", 1, deadline_s=0.0)  # an earlier attempt's, long overdue
    time.sleep(0.05)
    script = textwrap.dedent(
        f"""
        import time
        from prime_rl.common.heartbeat import Heartbeat
        hb = Heartbeat({str(beats)!r}, "trainer", rank=1, min_interval_s=0)
        for step in range(15):
            hb.beat("step", step, deadline_s=1.0)
            time.sleep(0.1)
        """
    )
    comps = [Component("trainer", [sys.executable, "-c", script], tmp_path / "t.log", finishes_run=True)]
    sup = Supervisor(comps, poll_s=0.05, heartbeat_dir=beats, watch_interval_s=0.1)
    assert sup.run() == 0, sup.reason


def _write_beat(directory: Path, component: str, rank: int, phase: str, age_s: float, deadline_s: float) -> None:
    import json
    from dataclasses import asdict

    from prime_rl.common.heartbeat import Beat

    now = time.time()
    directory.mkdir(parents=True, exist_ok=True)
    beat = Beat(component, rank, 4242 + rank, phase, 3, now - age_s, deadline_s, now)
    (directory / f"{component}-{rank}.json").write_text(json.dumps(asdict(beat)))


@pytest.mark.chaos
def test_verdict_names_the_stalled_process_not_the_one_waiting_on_it(tmp_path):
    """Probe: for a hanging reward the verdict named the trainer's 'step' (only waiting for the batch; it entered
    its phase first, so it is overdue first) and listed the orchestrator's 'rollouts' last. The orchestrator, a
    second short of its own deadline, is named; the trainer is listed as waiting on it. Per-step subdirectories
    (SLURM) are read and named; a process far from its deadline is not listed."""
    from prime_rl.launcher.stall import find_stall

    beats = tmp_path / "heartbeats"
    _write_beat(beats / "trainer-node0", "trainer", 0, "step", age_s=32, deadline_s=30)
    _write_beat(beats / "orchestrator", "orchestrator", 0, "rollouts", age_s=29, deadline_s=30)
    _write_beat(beats / "inference-node0", "inference", 0, "serving", age_s=1, deadline_s=60)
    (tmp_path / "orchestrator.log").write_text("step 2 | reward 0.1\n")
    verdict = find_stall(beats, 0.0, lambda beat, group: tmp_path / f"{group}.log")
    assert verdict is not None
    assert verdict.startswith(
        "watchdog: orchestrator rank 0 (pid 4242, orchestrator) stalled in phase 'rollouts' at step 3"
    )
    assert "last log line: step 2 | reward 0.1" in verdict
    assert verdict.endswith(
        "near or past their deadlines too: trainer rank 0 (trainer-node0) in 'step' for 32s "
        "(deadline 30s, waiting on orchestrator)"
    )
    assert "inference" not in verdict
    assert find_stall(beats, time.time() + 1, lambda beat, group: "") is None  # an earlier job's beats


def test_verdict_names_the_most_overdue_when_none_waits_on_another(tmp_path):
    """An orchestrator in 'waiting for policy' waits on the trainer: the trainer's stuck 'step' is named."""
    from prime_rl.launcher.stall import find_stall

    _write_beat(tmp_path / "hb", "orchestrator", 0, "waiting for policy", age_s=40, deadline_s=30)
    _write_beat(tmp_path / "hb", "trainer", 0, "step", age_s=29, deadline_s=30)
    verdict = find_stall(tmp_path / "hb", 0.0, lambda beat, group: "")
    assert verdict is not None and verdict.startswith("watchdog: trainer rank 0 ")
    assert "orchestrator rank 0 in 'waiting for policy'" in verdict


def test_verdict_lists_at_most_a_few_of_many_stuck_ranks(tmp_path):
    from prime_rl.launcher.stall import MAX_LISTED, find_stall

    for rank in range(20):
        _write_beat(tmp_path / "hb", "trainer", rank, "step", age_s=12 - rank * 0.01, deadline_s=10)
    verdict = find_stall(tmp_path / "hb", 0.0, lambda beat, group: "")
    assert verdict is not None and verdict.startswith("watchdog: trainer rank 0 ")
    assert verdict.count("in 'step' for") == MAX_LISTED and verdict.endswith(f"and {19 - MAX_LISTED} more")
