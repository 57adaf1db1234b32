"""A dead replica behind the router is restarted while the others serve, and re-admitted only once it serves the
weight version the others serve (replica_restarts.py). Stand-in processes and a stand-in router: no vLLM."""

import os
import signal
import subprocess
import sys

import pytest

from prime_rl.common.restarts import RestartPolicy
from prime_rl.common.testing_http import serve_http
from prime_rl.inference.replica_restarts import ReplicaRestarts

pytestmark = pytest.mark.chaos


class FakeRouter:
    """Records vllm-router's admin calls (POST /remove_worker?url=..., /add_worker?url=...)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.httpd = serve_http(post=lambda request: self.calls.append(request.path) or 200)
        self.port = self.httpd.server_address[1]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _replica(i: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)


@pytest.fixture
def setup():
    router = FakeRouter()
    replicas = [_replica(0), _replica(1)]
    state = {"healthy": [True, True], "version": [3, 3]}
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    restarts = ReplicaRestarts(
        urls, f"http://127.0.0.1:{router.port}", _replica, RestartPolicy(1, 3600.0), startup_timeout_s=30.0,
        healthy=lambda i: state["healthy"][i], version=lambda i: state["version"][i],
    )  # fmt: skip
    yield router, replicas, state, restarts
    for proc in replicas:
        proc.kill()
        proc.wait()
    router.close()


def test_a_dead_replica_is_taken_out_restarted_and_readmitted_once_it_serves_the_others_version(setup):
    router, replicas, state, restarts = setup
    first, other = replicas
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert restarts.check(replicas) is None
    assert replicas[0] is not first and replicas[0].poll() is None and replicas[1] is other  # only that one restarted
    assert router.calls == ["/remove_worker?url=http%3A%2F%2F127.0.0.1%3A1"]  # no request is routed to it meanwhile

    state["healthy"][0], state["version"][0] = False, None  # starting
    assert restarts.check(replicas) is None and len(router.calls) == 1
    state["healthy"][0], state["version"][0] = True, 0  # up, with the model's own weights: not yet
    assert restarts.check(replicas) is None and len(router.calls) == 1
    state["version"][0] = 3  # the orchestrator reloaded the policy into it
    assert restarts.check(replicas) is None
    assert router.calls[1] == "/add_worker?url=http%3A%2F%2F127.0.0.1%3A1" and not restarts.pending

    replicas[1].send_signal(signal.SIGKILL)  # the budget (1) is spent: the process ends naming both deaths
    replicas[1].wait()
    assert restarts.check(replicas) == 1
    assert "replica 1" in restarts.reason and "(SIGKILL)" in restarts.reason
    assert "no restart left (1/1" in restarts.reason and "replica 0" in restarts.reason


def test_a_replica_that_dies_while_restarting_ends_the_process_naming_both_causes(setup):
    router, replicas, state, restarts = setup
    replicas[0].send_signal(signal.SIGKILL)
    replicas[0].wait()
    assert restarts.check(replicas) is None
    replicas[0].kill()
    replicas[0].wait()
    assert restarts.check(replicas) == 1
    assert "replica 0" in restarts.reason and "restart 1/1 died during start-up (SIGKILL)" in restarts.reason


def test_a_replica_alive_with_an_overdue_heartbeat_is_restarted_alone_and_its_old_beat_dropped(tmp_path):
    """Its engine errored (the API server beats "engine errored" with no deadline) or wedged: the replica's process
    lives on, and the launcher, which would restart every replica for it, does not read its beats."""
    from prime_rl.common.heartbeat import Heartbeat

    router = FakeRouter()
    replicas = [_replica(0), _replica(1)]
    beats = [tmp_path / "inference-replica0", tmp_path / "inference-replica1"]
    restarts = ReplicaRestarts(
        ["http://127.0.0.1:1", "http://127.0.0.1:2"], f"http://127.0.0.1:{router.port}", _replica,
        RestartPolicy(1, 3600.0), startup_timeout_s=30.0, healthy=lambda i: True, version=lambda i: 3,
        beats=lambda i: beats[i],
    )  # fmt: skip
    try:
        for directory in beats:  # an overdue beat of another process (not in the replica's group) is not its stall
            Heartbeat(directory, "inference").beat("serving", deadline_s=0.0)
        assert restarts.check(replicas) is None and not restarts.pending
        wedged = replicas[1]
        beat = Heartbeat(beats[1], "inference")
        beat.beat("serving", deadline_s=60.0)
        path = beat.path
        data = path.read_text().replace(f'"pid": {os.getpid()}', f'"pid": {wedged.pid}')
        path.write_text(data.replace('"deadline_s": 60.0', '"deadline_s": 0.0'))  # the replica's own, overdue
        assert restarts.check(replicas) is None
        assert replicas[1] is not wedged and replicas[0].poll() is None  # that one alone
        assert wedged.wait(timeout=10) == -signal.SIGKILL  # its group stopped, not left running
        assert not beats[1].exists()
        assert router.calls == ["/remove_worker?url=http%3A%2F%2F127.0.0.1%3A2"]
        assert (
            "replica 1" in str(restarts.pending[1].cause) and "stalled in phase 'serving'" in restarts.pending[1].cause
        )
    finally:
        for proc in replicas:
            proc.kill()
            proc.wait()
        router.close()
