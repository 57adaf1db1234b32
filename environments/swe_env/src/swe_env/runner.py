"""Run pytest on a repository copy in a subprocess: a timeout, the whole process group killed, output bounded.

The tests run code the model wrote, so the run must end however that code behaves: the subprocess starts
its own session (process group), and when pytest returns or the timeout passes the whole group gets
SIGKILL (a `while True` or a `sleep` in a child the tests forked are both gone). Output is read by a thread
that keeps only a head and a tail, so a test printing without end costs bounded memory.

Only the process that started the run kills its group, so a worker that is itself SIGKILLed mid-run (the
orchestrator kills a worker whose call overran its rollout's budget, and every worker at shutdown) would
leave a hanging run behind for ever: coreutils `timeout` wraps the run as a backstop and kills the group on
its own `BACKSTOP_S` after the timeout.

The subprocess gets a minimal environment (no inherited variables: the orchestrator's tokens and keys
stay out of the model's reach), HOME and TMPDIR inside the rollout's temp dir, no bytecode files, and no
third-party pytest plugins (PYTEST_DISABLE_PLUGIN_AUTOLOAD: the same run whatever else is installed next
to the orchestrator; tasks are plain pytest). None of this is a sandbox: see the README's security notes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import IO

BACKSTOP_S = 2.0
"""Seconds past the timeout after which `timeout` (coreutils) kills the run's process group without us."""


@dataclass(frozen=True)
class PytestRun:
    output: str
    """pytest's output, at most about `max_output_chars` characters (head and tail kept)."""
    returncode: int | None
    """None when the run was killed at the timeout."""
    passed: int = 0
    """Tests that passed (from the JUnit report; 0 without one)."""
    total: int = 0
    """Tests that ran, skipped ones included (0 when the report is missing: killed, crashed, exited early)."""

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    @property
    def all_passed(self) -> bool:
        """Every test passed: none failed, errored or was skipped, and at least one ran."""
        return self.returncode == 0 and self.total > 0 and self.passed == self.total


def run_pytest(
    repo: Path, test_paths: list[str], *, scratch: Path, timeout: float, max_output_chars: int, report: bool = False
) -> PytestRun:
    """`python -m pytest -q <test_paths>` with cwd `repo`. `scratch` (outside `repo`) holds HOME, TMPDIR and,
    with `report`, the JUnit XML that counts passed tests; pytest's exit code alone can be faked by code that
    calls `os._exit(0)` at import."""
    junit = scratch / "report.xml"
    junit.unlink(missing_ok=True)
    home = scratch / "home"
    home.mkdir(exist_ok=True)
    backstop = shutil.which("timeout")  # without coreutils (not Linux) only our own kill below bounds the run
    cmd = [backstop, "-s", "KILL", f"{timeout + BACKSTOP_S:g}"] if backstop else []
    cmd += [sys.executable, "-m", "pytest", "-q", "--tb=short", "--color=no", "-p", "no:cacheprovider"]
    cmd += ["--rootdir", str(repo), *([f"--junitxml={junit}"] if report else []), "--", *test_paths]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "TMPDIR": str(home),
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    proc = subprocess.Popen(
        cmd, cwd=repo, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    reader = _BoundedReader(proc.stdout, max_output_chars)
    reader.start()
    try:
        returncode: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        returncode = None
    finally:
        kill_process_group(proc.pid)  # also what the tests left running after pytest returned
        proc.wait()
    # A process that left the group (setsid) may still hold the pipe: do not wait on it forever.
    reader.join(timeout=5.0)
    output = reader.text()
    if returncode is None:
        output += f"\n[killed: the tests ran longer than the {timeout:g}s timeout]"
    passed, total = _junit_counts(junit) if report and returncode is not None else (0, 0)
    return PytestRun(output, returncode, passed, total)


def kill_process_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is already gone
        pass


class _BoundedReader(threading.Thread):
    """Drains a pipe, keeping the first and the last `limit // 2` bytes."""

    def __init__(self, stream: IO[bytes], limit: int) -> None:
        super().__init__(daemon=True)
        self.stream, self.half = stream, max(limit // 2, 1)
        self.head, self.tail, self.size = bytearray(), bytearray(), 0

    def run(self) -> None:
        with self.stream:
            while chunk := self.stream.read1(65536):  # type: ignore[attr-defined]
                self.size += len(chunk)
                room = self.half - len(self.head)
                if room > 0:
                    self.head += chunk[:room]
                    chunk = chunk[room:]
                if chunk:
                    self.tail = (self.tail + chunk)[-self.half :]

    def text(self) -> str:
        head = self.head.decode("utf-8", errors="replace")
        if self.size <= len(self.head) + len(self.tail):
            return head + self.tail.decode("utf-8", errors="replace")
        cut = self.size - len(self.head) - len(self.tail)
        return f"{head}\n[... {cut} bytes of output cut ...]\n{self.tail.decode('utf-8', errors='replace')}"


def _junit_counts(path: Path) -> tuple[int, int]:
    """(passed, total) from pytest's JUnit XML; (0, 0) when it is missing or unreadable."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return 0, 0
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = sum(int(s.get("tests", 0)) for s in suites)
    bad = sum(int(s.get(k, 0)) for s in suites for k in ("failures", "errors", "skipped"))
    return max(total - bad, 0), total
