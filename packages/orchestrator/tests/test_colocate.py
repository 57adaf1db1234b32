"""HandOver (colocated runs) in the real orchestrator loop, with a fake OpenAI server, ZeroMQ trainer ranks
and a recording control plane: inference sleeps after each step's rollouts and before the trainer gets the
batch, no request reaches inference while it sleeps, and each load runs wake weights -> load -> wake KV."""

import time
from pathlib import Path

from packages.orchestrator.tests.test_orchestrator_e2e import FakeTrainer, make_config, run_orchestrator
from prime_rl.common.monitor import read_metrics
from prime_rl.common.rundir import RunDir
from prime_rl.orchestrator.envs.reverse_text import ReverseTextEnv


class SleepingControl:
    """Records every control call with the time and how many HTTP requests inference had answered by then."""

    def __init__(self, server):
        self.server = server
        self.calls: list[tuple] = []
        self.endpoints, self.excluded = ["tcp://fake:1"], set()

    def _record(self, *call) -> None:
        self.calls.append((*call, time.monotonic(), len(self.server.requests)))

    async def pause(self, mode):
        self._record("pause", mode)

    async def load_weights(self, path, version):
        self._record("load", version)

    async def resume(self):
        self._record("resume")

    async def sleep(self, level):
        self._record("sleep", level)

    async def wake_up(self, tags):
        self._record("wake_up", tuple(tags))

    def close(self):
        pass


def test_inference_sleeps_between_rollouts_and_wakes_around_each_load(tmp_path, make_server, ports):
    server = make_server()
    port = ports.free_range(2)
    config = make_config(tmp_path, server.base_url, port, max_off_policy_steps=0, inference={"sleep_level": 2})
    run_dir = RunDir(tmp_path, "run")
    trainer = FakeTrainer(run_dir, port, num_ranks=2, num_steps=3, weights_port=config.trainer.weights_port)
    control = SleepingControl(server)
    run_orchestrator(config, ReverseTextEnv(min_len=3, max_len=6), control)
    trainer.join()

    names = [c[0] if c[0] != "wake_up" else f"wake_{c[1][0]}" for c in control.calls]
    one_load = ["pause", "wake_weights", "load", "wake_kv_cache", "resume"]
    assert names == ["sleep", *one_load, "sleep", *one_load, "sleep"]  # three steps, two versions loaded between
    assert [c[1] for c in control.calls if c[0] == "sleep"] == [2, 2, 2]
    assert [c[1] for c in control.calls if c[0] == "load"] == [1, 2]

    # no request reached inference from a sleep until its KV cache was awake again
    sleeps = [c for c in control.calls if c[0] == "sleep"]
    woken = [c for c in control.calls if c[0] == "resume"]
    for asleep, awake in zip(sleeps, woken):
        assert asleep[-1] == awake[-1], "a request was sent to a sleeping server"
    # the trainer got each step's batch only once inference slept (its signal that the GPUs are free)
    arrivals = trainer.arrival_times[0]
    assert len(arrivals) == 3 and all(s[-2] < t for s, t in zip(sleeps, arrivals))

    metrics = read_metrics(run_dir.metrics_path)
    assert all(m["colocate/sleep_s"] >= 0 for m in metrics)
    assert "colocate/load_s" not in metrics[0]  # step 1 samples the initial weights: nothing woke
    for m in metrics[1:]:
        assert {"colocate/wake_weights_s", "colocate/load_s", "colocate/wake_kv_s", "colocate/asleep_s"} <= m.keys()
        assert m["colocate/asleep_s"] >= m["colocate/load_s"]


def test_with_a_push_transport_the_announcement_wakes_the_kv_cache_after_the_trainer_pushed(
    tmp_path, make_server, ports
):
    """ipc: the trainer wakes the weights and pushes (recorded here as "trainer_push"); the orchestrator neither
    pauses nor loads, and wakes the KV cache only once the pushed version is announced, before any request."""
    server = make_server()
    port = ports.free_range(2)
    config = make_config(tmp_path, server.base_url, port, max_off_policy_steps=0, inference={"sleep_level": 1})
    run_dir = RunDir(tmp_path, "run")
    control = SleepingControl(server)
    trainer = FakeTrainer(run_dir, port, num_ranks=2, num_steps=3, weights_port=config.trainer.weights_port,
                          push=lambda version: control._record("trainer_push", version))  # fmt: skip
    run_orchestrator(config, ReverseTextEnv(min_len=3, max_len=6), control)
    trainer.join()

    names = [c[0] if c[0] != "wake_up" else f"wake_{c[1][0]}" for c in control.calls]
    assert names == ["sleep", "trainer_push", "wake_kv_cache", "sleep", "trainer_push", "wake_kv_cache", "sleep"]
    assert not run_dir.broadcasts_dir.exists() or not any(run_dir.broadcasts_dir.iterdir())  # no disk
    sleeps = [c for c in control.calls if c[0] == "sleep"]
    woken = [c for c in control.calls if c[0] == "wake_up"]
    for asleep, awake in zip(sleeps, woken):
        assert asleep[-1] == awake[-1], "a request was sent to a sleeping server"
    metrics = read_metrics(run_dir.metrics_path)
    assert [m["policy/version"] for m in metrics] == [0, 1, 2]  # each step samples the version just pushed
    for m in metrics[1:]:
        assert {"colocate/wake_kv_s", "colocate/asleep_s"} <= m.keys() and "colocate/load_s" not in m


def test_every_nodes_server_is_put_to_sleep_and_woken_around_each_load(control_plane, monkeypatch):
    """Colocated under SLURM, one server per node: the hand-over reaches every server's control plane (real
    ZeroMQ), so no node's vLLM keeps its GPUs while the trainer steps there, and every node's loads the version."""
    import asyncio

    from prime_rl.common.env import SECRET_FILE_ENV
    from prime_rl.orchestrator.colocate import HandOver
    from prime_rl.orchestrator.policy import PolicyState
    from prime_rl.orchestrator.weights import ZmqInferenceControl

    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)  # the planes have no run secret: neither may the clients
    nodes = [control_plane(), control_plane()]
    control = ZmqInferenceControl([plane.endpoint for plane in nodes], timeout=10)
    hand_over = HandOver(control, PolicyState(), level=2)

    async def step():
        await hand_over.sleep()
        await hand_over.load_weights(Path("/run/broadcasts/step_1"), 1)

    try:
        asyncio.run(step())
    finally:
        control.close()
    for plane in nodes:
        assert [name for name, _ in plane.requests] == [
            "SleepRequest", "WakeUpRequest", "LoadWeightsRequest", "WakeUpRequest"
        ]  # fmt: skip
        assert plane.version == 1
