"""WeightUpdater: versions come only from the trainer's WeightsPublished messages over a real ZeroMQ socket."""

import asyncio
import time
from pathlib import Path

import pytest

from prime_rl.common.env import SECRET_FILE_ENV
from prime_rl.common.net import free_port
from prime_rl.common.rundir import BROADCAST_MARKER, RunDir
from prime_rl.common.transport import Sender
from prime_rl.common.wire import PauseRequest, WeightsPublished
from prime_rl.orchestrator.policy import PolicyState
from prime_rl.orchestrator.weights import VersionListener, WeightUpdater, ZmqInferenceControl


class FakeControl:
    """Records control calls; optionally fails load_weights."""

    def __init__(self, fail_load: bool = False):
        self.calls: list[tuple] = []
        self.fail_load = fail_load

    async def pause(self, mode):
        self.calls.append(("pause", mode))

    async def load_weights(self, path, version):
        self.calls.append(("load", Path(path).name, version))
        if self.fail_load:
            raise RuntimeError("server refused weights")

    async def resume(self):
        self.calls.append(("resume",))

    def close(self):
        pass


def publish(broadcasts: Path, step: int, complete: bool = True) -> Path:
    d = broadcasts / f"step_{step}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"")
    if complete:
        (d / BROADCAST_MARKER).touch()
    return d


class Trainer:
    """The trainer's end: a PUSH socket to the orchestrator's version socket."""

    def __init__(self, endpoint: str):
        self.sender = Sender(endpoint, timeout_s=5)

    def announce(self, version: int, path: Path | None = None) -> None:
        self.sender.send(WeightsPublished(version=version, path=None if path is None else str(path)))


def _updater(control, policy, **kwargs):
    listener = VersionListener(f"tcp://127.0.0.1:{free_port()}")
    listener.open()
    return WeightUpdater(listener, control, policy, poll_interval=0.01, **kwargs), Trainer(listener.endpoint)


async def _until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_announcements_load_newest_filesystem_version_and_retag(tmp_path):
    async def go():
        policy, control = PolicyState(), FakeControl()
        updater, trainer = _updater(control, policy, pause_mode="wait")
        assert not await updater.update_once()
        publish(tmp_path, 1)
        publish(tmp_path, 2)
        # A directory alone is invisible: the orchestrator learns versions from announcements only.
        await asyncio.sleep(0.05)
        assert not await updater.update_once() and policy.version == 0
        trainer.announce(1, tmp_path / "step_1")
        trainer.announce(2, tmp_path / "step_2")

        def saw_version_2() -> bool:  # poll drains what arrived; version 1 alone must not end the wait (CI, load 2+)
            updater.listener.poll()
            return updater.listener.latest is not None and updater.listener.latest.version == 2

        await _until(saw_version_2)
        assert await updater.update_once()
        assert not await updater.update_once()  # nothing newer
        assert policy.version == 2 and policy.is_open
        assert await policy.wait_for(2) == 2
        updater.listener.close()
        return control.calls

    assert asyncio.run(go()) == [("pause", "wait"), ("load", "step_2", 2), ("resume",)]


def test_pushed_version_is_served_without_a_load():
    async def go():
        policy, control = PolicyState(), FakeControl()
        updater, trainer = _updater(control, policy)
        trainer.announce(3)  # nccl / nixl: inference already serves it
        await updater.wait_for_version(3, timeout=5)
        assert policy.version == 3 and policy.is_open
        assert updater.last_announcement.path is None
        updater.listener.close()
        return control.calls

    assert asyncio.run(go()) == []


def test_gate_holds_requests_until_the_announcement_and_wait_for_version_times_out(tmp_path):
    async def go():
        policy = PolicyState()
        updater, trainer = _updater(FakeControl(), policy)
        waiter = asyncio.create_task(policy.wait_for(1))
        await asyncio.sleep(0.02)
        assert not waiter.done()  # version 0 < 1
        d = publish(tmp_path, 1)
        asyncio.get_running_loop().call_later(0.05, trainer.announce, 1, d)
        await updater.wait_for_version(1, timeout=5)
        assert await asyncio.wait_for(waiter, 1) == 1
        with pytest.raises(TimeoutError, match="announce policy version 3 .*newest announced is 1"):
            await updater.wait_for_version(3, timeout=0.05)
        updater.listener.close()

    asyncio.run(go())


def test_max_off_policy_zero_waits_for_exactly_the_current_version(tmp_path):
    """max_off_policy_steps = 0: step s waits for version s, and an older announcement does not satisfy it."""

    async def go():
        policy = PolicyState()
        updater, trainer = _updater(FakeControl(), policy)
        trainer.announce(1, publish(tmp_path, 1))
        await updater.wait_for_version(1, timeout=5)
        waiting = asyncio.create_task(updater.wait_for_version(2, timeout=5))
        await asyncio.sleep(0.1)
        assert not waiting.done() and policy.version == 1
        trainer.announce(2, publish(tmp_path, 2))
        await asyncio.wait_for(waiting, 5)
        assert policy.version == 2
        updater.listener.close()

    asyncio.run(go())


def test_failed_load_still_resumes_and_keeps_version(tmp_path):
    async def go():
        policy, control = PolicyState(), FakeControl(fail_load=True)
        updater, trainer = _updater(control, policy)
        trainer.announce(1, publish(tmp_path, 1))
        await _until(lambda: updater.listener.poll() is not None or updater.listener.latest is not None)
        with pytest.raises(RuntimeError, match="refused"):
            await updater.update_once()
        assert policy.version == 0 and policy.is_open
        updater.listener.close()
        return control.calls

    assert asyncio.run(go())[-1] == ("resume",)


def test_a_failed_background_update_is_the_error_the_run_stops_with(tmp_path):
    """The poller fails a load and closes the version socket; the step loop's next wait re-raises that failure
    (it used to re-open the socket and die with 'Address already in use', hiding the cause)."""

    async def go():
        policy, control = PolicyState(), FakeControl(fail_load=True)
        updater, trainer = _updater(control, policy)
        poller = asyncio.create_task(updater.run())
        trainer.announce(1, publish(tmp_path, 1))
        with pytest.raises(RuntimeError, match="server refused weights"):
            await asyncio.wait_for(poller, timeout=5)
        with pytest.raises(RuntimeError, match="server refused weights"):
            await updater.wait_for_version(1, timeout=1)

    asyncio.run(go())


class SlowFailingControl(FakeControl):
    """A load that fails after ``started`` is set: the step loop can be made to wait for the lock meanwhile."""

    def __init__(self):
        super().__init__(fail_load=True)
        self.started, self.release = asyncio.Event(), asyncio.Event()

    async def load_weights(self, path, version):
        self.started.set()
        await self.release.wait()
        await super().load_weights(path, version)


def test_a_background_update_failing_while_a_step_waits_for_it_is_the_error_the_step_raises(tmp_path):
    """The step loop waits for the update lock while the poller's load fails: it raises that failure at once. It
    used to re-open the version socket the poller had just closed and load the failed version again, or die with
    'Address already in use' when the closed socket had not let go of its port yet (CI saw this once)."""

    async def go():
        policy, control = PolicyState(), SlowFailingControl()
        updater, trainer = _updater(control, policy)
        poller = asyncio.create_task(updater.run())
        trainer.announce(1, publish(tmp_path, 1))
        await asyncio.wait_for(control.started.wait(), timeout=5)  # the poller holds the lock, loading
        step = asyncio.create_task(updater.wait_for_version(1, timeout=5))
        await asyncio.sleep(0.05)  # the step is past its first check, waiting for the lock
        assert not step.done()
        control.release.set()
        with pytest.raises(RuntimeError, match="server refused weights"):
            await asyncio.wait_for(poller, timeout=5)
        with pytest.raises(RuntimeError, match="server refused weights"):
            await asyncio.wait_for(step, timeout=5)
        # the step did not re-open the closed socket and load the failed version a second time
        assert [c for c in control.calls if c[0] == "load"] == [("load", "step_1", 1)]

    asyncio.run(go())


def test_recover_loads_the_newest_complete_version_up_to_the_resume_step(tmp_path):
    async def go():
        policy, control = PolicyState(), FakeControl()
        updater, _ = _updater(control, policy)
        run_dir = RunDir(tmp_path, "run")
        for step in (3, 4, 6):  # 6: from a run that went further before the one we resume crashed
            publish(run_dir.broadcasts_dir, step)
        assert await updater.recover(run_dir, max_version=5)
        assert policy.version == 4
        updater.listener.close()
        return control.calls

    assert asyncio.run(go()) == [("pause", "keep"), ("load", "step_4", 4), ("resume",)]


def test_listener_refuses_other_messages():
    listener = VersionListener(f"tcp://127.0.0.1:{free_port()}")
    receiver = listener.open()
    sender = Sender(listener.endpoint, timeout_s=5)
    sender.send(PauseRequest(mode="keep"))
    sender.send(WeightsPublished(version=7))
    deadline = time.monotonic() + 5
    while listener.latest is None and time.monotonic() < deadline:
        listener.poll()
        time.sleep(0.01)
    assert listener.latest.version == 7 and receiver.num_rejected == 1
    sender.close()
    listener.close()


def test_wait_for_version_marks_the_orchestrators_steps_for_the_watchdog(tmp_path):
    """The orchestrator's heartbeat: waiting for a policy (deadline weights_timeout), then rollouts until
    the next step's wait (the run's stall timeout); a step that never ends is what the watchdog sees."""
    from prime_rl.common.heartbeat import Heartbeat, read_beats

    async def go():
        policy = PolicyState()
        heartbeat = Heartbeat(tmp_path / "hb", "orchestrator", default_deadline_s=30, min_interval_s=0)
        updater, trainer = _updater(FakeControl(), policy, heartbeat=heartbeat)
        d = publish(tmp_path, 1)
        asyncio.get_running_loop().call_later(0.05, trainer.announce, 1, d)
        waiting = asyncio.create_task(updater.wait_for_version(1, timeout=7))
        await asyncio.sleep(0.02)
        (during,) = read_beats(tmp_path / "hb")
        await waiting
        (after,) = read_beats(tmp_path / "hb")
        updater.listener.close()
        return during, after

    during, after = asyncio.run(go())
    assert (during.component, during.phase, during.step, during.deadline_s) == (
        "orchestrator",
        "waiting for policy",
        1,
        7,
    )
    assert (after.phase, after.step, after.deadline_s) == ("rollouts", 1, 30) and after.since >= during.since


def test_pause_names_the_orchestrator():
    from prime_rl.orchestrator.weights import ZmqInferenceControl

    sent = []
    control = ZmqInferenceControl([f"tcp://127.0.0.1:{free_port()}"])  # connects lazily: nothing is sent

    async def record(message):
        sent.append(message)

    control._broadcast = record
    asyncio.run(control.pause("keep"))
    control.close()
    assert sent == [PauseRequest(mode="keep", by="orchestrator")]


def test_an_update_answered_by_a_restarted_server_is_lost_not_applied(tmp_path, control_plane, monkeypatch):
    """Probe (issue 35): a server that died between two updates and came back before the next one answered that
    update as if nothing happened (ZeroMQ queued the request; the restart answered it), so the orchestrator never
    counted the outage. The new boot id makes it an update lost to a restart, which the watch heals."""
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)  # the plane has no run secret: neither may the clients
    plane = control_plane()
    control = ZmqInferenceControl([plane.endpoint], timeout=10)
    lost: list[str] = []

    async def on_unanswered(reason: str) -> None:
        lost.append(reason)

    async def go():
        policy = PolicyState()
        updater, trainer = _updater(control, policy)
        updater.on_unanswered = on_unanswered
        trainer.announce(1, publish(tmp_path, 1))
        await _until(lambda: updater.listener.poll() is not None or updater.listener.latest is not None)
        assert await updater.update_once() and policy.version == 1
        plane.restart()
        trainer.announce(2, publish(tmp_path, 2))
        await _until(lambda: updater.listener.poll() is not None and updater.listener.latest.version == 2)
        assert not await updater.update_once()
        assert policy.version == 1 and policy.is_open, "the update did not reach the process that serves now"
        # the watch's health polls see the new process without failing (that restart is the one being waited out);
        # None until the health socket has reconnected to it
        deadline = time.monotonic() + 10
        while (reply := (await control.health())[0]) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert reply is not None and reply.ok and reply.boot_id == plane.boot_id
        assert await updater.update_once() and policy.version == 2  # applied again, to the new process
        updater.listener.close()

    try:
        asyncio.run(go())
    finally:
        control.close()
    assert len(lost) == 1 and "ServerRestartedError" in lost[0] and "restarted since its last answer" in lost[0], lost
    # the new process was resumed after the lost update (it answered the pause), never left paused
    after = [name for name, boot in plane.requests if boot == plane.boot_id]
    assert after[:2] == ["PauseRequest", "ResumeRequest"], after


def test_a_replica_whose_engine_died_under_a_pause_loses_the_update_while_the_router_stays_healthy(
    tmp_path, control_plane, monkeypatch
):
    """CI (issue 35): two replicas behind a router; replica 1's engine core was killed and its API server answered
    the next update's PauseRequest with EngineDeadError. The HTTP route stayed healthy (replica 0 serves), so that
    error was taken for a refused update and stopped the run. Its own health failing makes it a death: the update is
    lost (the watch takes the replica out and heals it), the live replica is resumed, the old version kept."""
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)  # the planes have no run secret: neither may the clients
    planes = [control_plane(), control_plane()]
    control = ZmqInferenceControl([p.endpoint for p in planes], timeout=10)
    lost: list[str] = []

    async def on_unanswered(reason: str) -> None:
        lost.append(reason)

    async def router_healthy_so_not_gone() -> bool:
        return False

    async def go():
        policy = PolicyState()
        updater, trainer = _updater(control, policy)
        updater.on_unanswered, updater.server_gone = on_unanswered, router_healthy_so_not_gone
        planes[1].engine_dead = True
        trainer.announce(1, publish(tmp_path, 1))
        await _until(lambda: updater.listener.poll() is not None or updater.listener.latest is not None)
        assert not await updater.update_once()
        assert policy.version == 0 and policy.is_open
        updater.listener.close()

    try:
        asyncio.run(go())
    finally:
        control.close()
    assert len(lost) == 1 and "ServerGoneError" in lost[0] and "EngineDeadError" in lost[0], lost
    assert [name for name, _ in planes[0].requests] == ["PauseRequest", "ResumeRequest"], planes[0].requests
