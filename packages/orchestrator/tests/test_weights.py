import asyncio
from pathlib import Path

import pytest

from prime_rl.orchestrator.policy import PolicyState
from prime_rl.orchestrator.weights import BROADCAST_MARKER, WeightUpdater, latest_published_step


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


def publish(broadcasts: Path, step: int, complete: bool = True) -> None:
    d = broadcasts / f"step_{step}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"")
    if complete:
        (d / BROADCAST_MARKER).touch()


def test_latest_published_step_needs_marker(tmp_path):
    assert latest_published_step(tmp_path / "missing") is None
    publish(tmp_path, 1)
    publish(tmp_path, 3, complete=False)  # still being written
    assert latest_published_step(tmp_path) == 1


def test_update_pauses_loads_newest_resumes_and_retags(tmp_path):
    async def go():
        policy, control = PolicyState(), FakeControl()
        updater = WeightUpdater(tmp_path, control, policy, pause_mode="wait", poll_interval=0.01)
        assert not await updater.update_once()
        publish(tmp_path, 1)
        publish(tmp_path, 2)
        assert await updater.update_once()
        assert not await updater.update_once()  # nothing newer
        assert policy.version == 2 and policy.is_open
        assert await policy.wait_for(2) == 2
        return control.calls

    assert asyncio.run(go()) == [("pause", "wait"), ("load", "step_2", 2), ("resume",)]


def test_gate_holds_requests_during_update_and_wait_for_version(tmp_path):
    async def go():
        policy = PolicyState()
        updater = WeightUpdater(tmp_path, FakeControl(), policy, poll_interval=0.01)
        waiter = asyncio.create_task(policy.wait_for(1))
        await asyncio.sleep(0.02)
        assert not waiter.done()  # version 0 < 1
        asyncio.get_running_loop().call_later(0.05, publish, tmp_path, 1)
        await updater.wait_for_version(1, timeout=5)
        assert await asyncio.wait_for(waiter, 1) == 1
        with pytest.raises(TimeoutError, match="step_3/STABLE"):
            await updater.wait_for_version(3, timeout=0.05)

    asyncio.run(go())


def test_failed_load_still_resumes_and_keeps_version(tmp_path):
    async def go():
        policy, control = PolicyState(), FakeControl(fail_load=True)
        publish(tmp_path, 1)
        with pytest.raises(RuntimeError, match="refused"):
            await WeightUpdater(tmp_path, control, policy).update_once()
        assert policy.version == 0 and policy.is_open
        return control.calls

    assert asyncio.run(go())[-1] == ("resume",)
