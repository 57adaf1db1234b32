"""Fixtures: an environment on the bundled tasks whose per-call copies go to a folder the test can inspect."""

from __future__ import annotations

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
