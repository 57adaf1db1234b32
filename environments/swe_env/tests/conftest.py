"""Fixtures: an environment on the bundled tasks whose per-call copies go to a folder the test can inspect."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from swe_env import SWEEnvironment


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """Where the environment makes its per-call copies; every test's calls must leave it empty."""
    path = tmp_path / "work"
    path.mkdir()
    yield path
    assert list(path.iterdir()) == [], "a temp copy of a task's repository was not removed"


@pytest.fixture
def env(workdir: Path) -> SWEEnvironment:
    return SWEEnvironment(workdir=str(workdir), test_timeout=60.0)


@pytest.fixture
def gone() -> Callable[..., bool]:
    """`gone(pid, within)`: the process exits within `within` seconds (a zombie that init has not reaped yet
    counts: it runs no code)."""

    def check(pid: int, within: float = 10.0) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                return True
            if state in ("Z", "X"):
                return True
            time.sleep(0.1)
        return False

    return check
