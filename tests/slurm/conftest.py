"""Fixtures for the SLURM tests: a real two-node cluster on this machine (scripts/slurm_cluster.sh)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from prime_rl.common import net

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO / "scripts" / "slurm_cluster.sh"
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}


def free_port_range(count: int) -> int:
    """The first of ``count`` consecutive free TCP ports, in 10000-19999: below Linux's ephemeral range (32768+,
    where any process's outgoing connection or port-0 bind may land) and the orchestrator tests' 20000-32000 (a
    checked-free port can still be taken by a test running beside this one before the job binds it)."""
    return net.free_port_range(count, 10000, 20000)


class Cluster:
    def __init__(self, root: Path, env: dict[str, str], nodes: list[str]) -> None:
        self.root = root
        self.env = env
        self.nodes = nodes

    def job_state(self, job_id: str) -> tuple[str, str]:
        """(JobState, ExitCode) from ``scontrol show job`` (no slurmdbd here, so no sacct)."""
        out = subprocess.run(
            ["scontrol", "show", "job", job_id], capture_output=True, text=True, env=self.env, check=True
        ).stdout
        fields = dict(tok.split("=", 1) for tok in out.split() if "=" in tok)
        return fields["JobState"], fields["ExitCode"]

    def wait(self, job_id: str, timeout: float) -> tuple[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            state, code = self.job_state(job_id)
            if state in TERMINAL_STATES:
                return state, code
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job_id], env=self.env)
                raise AssertionError(f"job {job_id} still {state} after {timeout} s")
            time.sleep(0.5)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root (slurmd, /etc/hosts, UTS namespaces)")
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        pytest.skip("SLURM is not installed and apt-get is not available to install it")
    root = tmp_path_factory.mktemp("slurm")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw")
    prefix = f"pr{worker.removeprefix('gw')}n"  # distinct node names per xdist worker
    base = free_port_range(3)
    env = {**os.environ, "NODE_PREFIX": prefix}
    up = subprocess.run(
        ["bash", str(CLUSTER_SCRIPT), "up", str(root), "2", str(base)], capture_output=True, text=True, env=env
    )
    if up.returncode != 0:
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "down", str(root)])
        raise RuntimeError(f"slurm cluster did not start: {up.stderr[-2000:]}")
    env["SLURM_CONF"] = str(root / "slurm.conf")
    yield Cluster(root, env, [f"{prefix}1", f"{prefix}2"])
    subprocess.run(["bash", str(CLUSTER_SCRIPT), "down", str(root)])


@pytest.fixture
def free_port() -> int:
    return free_port_range(1)


@pytest.fixture
def free_ports():
    """``free_ports(n)``: the first of n consecutive free ports."""
    return free_port_range
