"""A test run outlives no one: when the worker that started it is killed mid-run (the orchestrator SIGKILLs a
worker whose call overran its rollout's budget), the backstop kills the run's whole process group."""

from __future__ import annotations

import subprocess
import sys
import time

from swe_env.runner import BACKSTOP_S

HANG = """
import os, subprocess

def test_hang():
    sleeper = subprocess.Popen(["sleep", "300"])
    with open({pid_file!r}, "w") as f:
        f.write(str(sleeper.pid))
    while True:
        pass
"""

WORKER = """
import sys
from pathlib import Path
from swe_env.runner import run_pytest

repo, scratch = Path(sys.argv[1]), Path(sys.argv[2])
run_pytest(repo, ["test_hang.py"], scratch=scratch, timeout=float(sys.argv[3]), max_output_chars=1000)
"""


def test_a_killed_worker_leaves_no_test_run_behind(tmp_path, gone):
    repo, scratch, pid_file = tmp_path / "repo", tmp_path / "scratch", tmp_path / "sleeper.pid"
    repo.mkdir(), scratch.mkdir()
    (repo / "test_hang.py").write_text(HANG.format(pid_file=str(pid_file)))
    timeout = 3.0
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(repo), str(scratch), str(timeout)])
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and worker.poll() is None, "the test run never started"
            time.sleep(0.05)
    finally:
        worker.kill()  # as the orchestrator kills an overrunning worker: no chance to clean up
        worker.wait()
    sleeper = int(pid_file.read_text())
    assert not gone(sleeper, within=0.5)  # orphaned, still running: only the backstop can end it
    assert gone(sleeper, within=timeout + BACKSTOP_S + 10), "the test run outlived its worker past the backstop"
