import json
import os
import time
from pathlib import Path

import pytest

from prime_rl.launcher.dashboard.status import StatusTracker, read_status_file, write_status

from .helpers import append_metrics, make_run


def age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def metrics_mtime(run: Path) -> float:
    return (run / "monitors" / "file" / "metrics.jsonl").stat().st_mtime


def test_recent_writes_mean_running(tmp_path: Path) -> None:
    run = make_run(tmp_path, "r", steps=2, logs={"orchestrator.log": "INFO step 2 done\n"})
    assert StatusTracker(run).state(metrics_mtime(run)) == "running"


@pytest.mark.parametrize(
    "log_name, text",
    [
        ("trainer/torchrun/1.log", "Traceback (most recent call last):\n  File 'x.py'\nValueError: boom\n"),
        ("orchestrator.log", "2026-11-30 12:00:00 ERROR orchestrator: lost inference server\n"),
        ("inference.log", "[ERROR] engine died\n"),
        ("trainer/torchrun/0.log", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"),
        ("trainer/torchrun/0.log", "  exitcode  : 1 (pid: 1234)\n"),
        ("orchestrator.log", "trainer exited with code 3\n"),
    ],
)
def test_failure_markers_mean_failed(tmp_path: Path, log_name: str, text: str) -> None:
    run = make_run(tmp_path, "r", steps=1, logs={log_name: "INFO starting\n" + text})
    tracker = StatusTracker(run)
    assert tracker.state(metrics_mtime(run)) == "failed"
    assert log_name.split("/")[-1] in tracker.reason


def test_failure_reason_names_the_exception(tmp_path: Path) -> None:
    tb = 'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n    step()\n'
    run = make_run(tmp_path, "r", steps=1, logs={"trainer/torchrun/0.log": tb + "torch.OutOfMemoryError: CUDA OOM\n"})
    tracker = StatusTracker(run)
    assert tracker.state(metrics_mtime(run)) == "failed"
    assert tracker.reason == "logs/latest/trainer/torchrun/0.log: torch.OutOfMemoryError: CUDA OOM"


@pytest.mark.parametrize(
    "text", ["INFO no errors so far, ERRORS=0\n", "exit code 0\n", "exitcode  : 0\n", "loaded error_model.py\n"]
)
def test_benign_lines_are_not_failures(tmp_path: Path, text: str) -> None:
    run = make_run(tmp_path, "r", steps=1, logs={"trainer/torchrun/0.log": text})
    assert StatusTracker(run).state(metrics_mtime(run)) == "running"


def test_finished_marker_and_stale_rule(tmp_path: Path) -> None:
    done = make_run(tmp_path, "done", steps=3, logs={"trainer/torchrun/0.log": "INFO Finished training!\n"})
    assert StatusTracker(done).state(metrics_mtime(done)) == "finished"

    quiet = make_run(tmp_path, "quiet", steps=3, logs={"orchestrator.log": "INFO step 3\n"})
    for p in [quiet / "monitors/file/metrics.jsonl", quiet / "logs/attempt_0/orchestrator.log"]:
        age(p, 1000)
    tracker = StatusTracker(quiet, stale_after_s=300)
    assert tracker.state(metrics_mtime(quiet)) == "stale"
    append_metrics(quiet, {"step": 4})  # it wakes up again
    assert tracker.state(metrics_mtime(quiet)) == "running"


def test_error_appended_later_is_seen_incrementally(tmp_path: Path) -> None:
    run = make_run(tmp_path, "r", steps=1, logs={"trainer/torchrun/0.log": "INFO step 1\n"})
    tracker = StatusTracker(run)
    assert tracker.state(metrics_mtime(run)) == "running"
    log = run / "logs/latest/trainer/torchrun/0.log"
    with open(log, "a") as f:
        f.write("Traceback (most recent call")  # unfinished line: not judged yet
    assert tracker.state(metrics_mtime(run)) == "running"
    with open(log, "a") as f:
        f.write(" last):\nRuntimeError: NCCL timeout\n")
    assert tracker.state(metrics_mtime(run)) == "failed"


@pytest.mark.parametrize(
    "rel, text, want",
    [
        ("logs/latest/STATUS", json.dumps({"state": "finished"}), "finished"),
        ("logs/latest/STATUS", "failed\n", "failed"),
        ("status.json", json.dumps({"state": "Running", "pid": 1}), "running"),
        ("logs/latest/STATUS", json.dumps({"state": "exploded"}), None),  # unknown word: ignored
    ],
)
def test_status_file_wins(tmp_path: Path, rel: str, text: str, want: str | None) -> None:
    run = make_run(tmp_path, "r", steps=1, logs={"trainer/torchrun/0.log": "Traceback (most recent call last):\n"})
    (run / rel).write_text(text)
    assert read_status_file(run) == want
    expected = want or "failed"  # without a usable status file the log rule decides
    assert StatusTracker(run).state(metrics_mtime(run)) == expected


def test_write_status_round_trip(tmp_path: Path) -> None:
    run = make_run(tmp_path, "r", steps=1)
    path = write_status(run, "failed", reason="trainer exited with code 1", exit_code=1)
    assert path == run / "logs/latest/STATUS"
    assert json.loads(path.read_text())["exit_code"] == 1
    tracker = StatusTracker(run)
    assert tracker.state(metrics_mtime(run)) == "failed"
    assert tracker.reason == "trainer exited with code 1"
    write_status(run, "finished")
    assert tracker.state(metrics_mtime(run)) == "finished"
    with pytest.raises(ValueError, match="not one of"):
        write_status(run, "exploded")


@pytest.mark.chaos
def test_running_status_of_a_vanished_launcher_reads_failed(tmp_path: Path) -> None:
    """Probe: STATUS stayed "running" after the launcher was SIGKILLed."""
    import socket
    import subprocess
    import sys

    from prime_rl.launcher.dashboard.status import read_status

    run = make_run(tmp_path, "r", steps=1)
    write_status(run, "running", pid=os.getpid(), host=socket.gethostname())
    assert read_status(run)[0] == "running"  # this process is alive
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_status(run, "running", pid=int(dead.stdout), host=socket.gethostname())
    state, reason = read_status(run)
    assert state == "failed" and "is gone" in reason
    write_status(run, "running", pid=int(dead.stdout), host="another-node")  # cannot tell from here
    assert read_status(run)[0] == "running"


def test_a_running_status_whose_pid_was_reused_reads_failed(tmp_path: Path) -> None:
    """A SIGKILLed launcher's pid may be carried by another process later: the start time tells them apart."""
    import json
    import socket

    from prime_rl.launcher.dashboard.status import read_status

    run = make_run(tmp_path, "r", steps=1)
    path = write_status(run, "running", pid=os.getpid(), host=socket.gethostname())
    status = json.loads(path.read_text())
    assert isinstance(status["pid_start"], int) and read_status(run)[0] == "running"
    path.write_text(json.dumps({**status, "pid_start": status["pid_start"] - 1}))  # same pid, another process
    state, reason = read_status(run)
    assert state == "failed" and "is gone" in reason


@pytest.mark.chaos
def test_the_dead_launchers_attempt_status_is_settled_as_failed(tmp_path: Path) -> None:
    """Probe: a SIGKILLed launcher left attempt_N/STATUS at "running" for every reader that reads the file."""
    import json
    import signal
    import socket
    import subprocess
    import sys

    from prime_rl.launcher.dashboard.status import settle_dead_status

    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    path = write_status(tmp_path, "running", pid=launcher.pid, host=socket.gethostname())
    assert settle_dead_status(path) is None  # alive: untouched
    assert json.loads(path.read_text())["state"] == "running"
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    reason = settle_dead_status(path)
    assert reason is not None and f"pid {launcher.pid}" in reason and "died without a final status" in reason
    settled = json.loads(path.read_text())
    assert settled["state"] == "failed" and settled["reason"] == reason
    assert settle_dead_status(path) is None  # already final
