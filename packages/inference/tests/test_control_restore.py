"""Controller semantics with a recording fake engine (no vLLM): a failed load is undone before generation
resumes, health says when it could not be, and every state change is logged with its origin."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
from safetensors.numpy import save_file

from prime_rl.common.weight_checksum import write_checksums
from prime_rl.common.wire import HealthRequest, LoadWeightsRequest, PauseRequest, ResumeRequest
from prime_rl.inference.control import Controller
from prime_rl.inference.weights.manifest import Manifest, Spec

TENSORS = {"w": np.ones((4, 4), np.float32)}


class FakeEngine:
    """Records the calls the controller makes; ``fail_paths`` make prime_load_checkpoint raise."""

    def __init__(self, fail_paths: set[str] = frozenset()) -> None:
        self.calls: list[tuple] = []
        self.fail_paths = set(fail_paths)
        self.errored = False
        self.paused = False

    async def collective_rpc(self, method, args=()):
        self.calls.append((method, *args))
        if method == "prime_load_checkpoint" and args[0] in self.fail_paths:
            raise RuntimeError(f"worker could not read {args[0]}")
        return [{"tensors": 1}]

    async def pause_generation(self, mode):
        self.calls.append(("pause", mode))
        self.paused = True

    async def resume_generation(self):
        self.calls.append(("resume",))
        self.paused = False

    async def reset_prefix_cache(self, reset_running_requests=False):
        self.calls.append(("reset_prefix_cache",))

    async def update_weight_version(self, version):
        self.calls.append(("version", version))

    async def is_paused(self):
        return self.paused


def _step(root, n: int) -> str:
    path = root / f"step_{n}"
    path.mkdir()
    save_file(TENSORS, str(path / "model.safetensors"))
    write_checksums(path)
    (path / "STABLE").touch()
    return str(path)


def _controller(engine: FakeEngine, model_dir: str | None) -> Controller:
    manifest = Manifest(expected={"w": Spec("float32", (4, 4))}, optional={})
    return Controller(engine, manifest, model_name="m", run_id="abc", model_dir=model_dir)


@pytest.mark.chaos
def test_failed_load_restores_the_previous_weights_before_resuming(tmp_path, caplog):
    good, bad = _step(tmp_path, 1), _step(tmp_path, 2)
    engine = FakeEngine(fail_paths={bad})
    controller = _controller(engine, model_dir="/model")

    async def run():
        assert (await controller.handle(LoadWeightsRequest(path=good, version=1), "10.0.0.7")).ok
        engine.calls.clear()
        reply = await controller.handle(LoadWeightsRequest(path=bad, version=2), "10.0.0.7")
        return reply, await controller.handle(HealthRequest())

    with caplog.at_level(logging.INFO, logger="prime_rl.inference.control"):
        reply, health = asyncio.run(run())
    assert not reply.ok and "serves again" in reply.error and reply.weight_version == 1
    # The previous step (not the model dir) is reloaded while still paused; no version change.
    assert engine.calls == [
        ("pause", "keep"),
        ("prime_load_checkpoint", bad),
        ("prime_load_checkpoint", good),
        ("reset_prefix_cache",),
        ("resume",),
    ]
    assert health.ok and health.error == "" and health.run_id == "abc"
    assert f"LoadWeightsRequest(version=2, path={bad}) from 10.0.0.7" in caplog.text


def test_health_reports_a_failed_restore_until_an_update_succeeds(tmp_path):
    bad, good = _step(tmp_path, 2), _step(tmp_path, 3)
    engine = FakeEngine(fail_paths={bad, "/model"})
    controller = _controller(engine, model_dir="/model")

    async def run():
        reply = await controller.handle(LoadWeightsRequest(path=bad, version=2))
        sick = await controller.handle(HealthRequest())
        ok = await controller.handle(LoadWeightsRequest(path=good, version=3))
        return reply, sick, ok, await controller.handle(HealthRequest())

    reply, sick, ok, healed = asyncio.run(run())
    assert not reply.ok and "restoring the previous weights from /model failed too" in reply.error
    assert not sick.ok and "failed too" in sick.error
    assert ok.ok and healed.ok and healed.weight_version == 3 and healed.error == ""


@pytest.mark.chaos
def test_unverifiable_data_never_reaches_the_engine(tmp_path):
    path = _step(tmp_path, 4)
    file = tmp_path / "step_4" / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-3])
    engine = FakeEngine()
    reply = asyncio.run(_controller(engine, "/model").handle(LoadWeightsRequest(path=path, version=4)))
    assert not reply.ok and "truncated" in reply.error and "keeps the previous weights" in reply.error
    assert engine.calls == []


def test_pause_and_resume_are_logged_with_their_origin(caplog):
    controller = _controller(FakeEngine(), None)

    async def run():
        await controller.handle(PauseRequest(mode="keep"), "192.168.1.9")
        await controller.handle(ResumeRequest(), "192.168.1.9")

    with caplog.at_level(logging.INFO, logger="prime_rl.inference.control"):
        asyncio.run(run())
    assert "PauseRequest(mode=keep) from 192.168.1.9" in caplog.text
    assert "ResumeRequest from 192.168.1.9" in caplog.text


@pytest.mark.chaos
def test_heartbeat_reports_a_client_pause_with_its_deadline(tmp_path):
    """Probe: one PauseRequest froze a run silently. The server now reports who paused it and for how long
    that may last; the launcher's watchdog ends the run past ``weights.max_pause``."""
    from prime_rl.common.heartbeat import Heartbeat, read_beats
    from prime_rl.inference.control import beat_forever

    controller = _controller(FakeEngine(), None)
    heartbeat = Heartbeat(tmp_path, "inference", min_interval_s=0.0)

    async def run():
        task = asyncio.create_task(beat_forever(controller, heartbeat, max_pause_s=5.0, interval_s=0.01))
        await asyncio.sleep(0.05)
        serving = read_beats(tmp_path)[0]
        await controller.handle(PauseRequest(mode="keep"), "10.1.2.3")
        await asyncio.sleep(0.05)
        paused = read_beats(tmp_path)[0]
        await asyncio.sleep(0.05)
        still = read_beats(tmp_path)[0]
        task.cancel()
        return serving, paused, still

    serving, paused, still = asyncio.run(run())
    assert serving.phase == "serving" and serving.deadline_s == 60.0
    assert paused.phase == "paused by 10.1.2.3" and paused.deadline_s == 5.0
    assert still.since == paused.since  # a pause is not progress: its clock keeps running


def test_health_of_an_engine_that_does_not_answer_is_a_reply_not_a_traceback():
    engine = FakeEngine()

    async def dead():
        raise RuntimeError("engine core is shut down")

    engine.is_paused = dead
    reply = asyncio.run(_controller(engine, None).handle(HealthRequest()))
    assert not reply.ok and "does not answer" in reply.error and reply.run_id == "abc"


@pytest.mark.chaos
def test_heartbeat_reports_an_engine_core_that_stops_answering(tmp_path):
    """A stopped / wedged engine core (the API process still alive) is reported at once as overdue."""
    from prime_rl.common.heartbeat import Heartbeat, read_beats
    from prime_rl.inference.control import beat_forever

    engine = FakeEngine()
    controller = _controller(engine, None)
    heartbeat = Heartbeat(tmp_path, "inference", min_interval_s=0.0)

    async def never():
        await asyncio.Event().wait()

    async def run():
        task = asyncio.create_task(beat_forever(controller, heartbeat, 5.0, interval_s=0.01, liveness_s=0.05))
        await asyncio.sleep(0.05)
        serving = read_beats(tmp_path)[0]
        engine.is_paused = never
        await asyncio.sleep(0.2)
        stuck = read_beats(tmp_path)[0]
        engine.errored = True
        await asyncio.sleep(0.1)
        dead = read_beats(tmp_path)[0]
        task.cancel()
        return serving, stuck, dead

    serving, stuck, dead = asyncio.run(run())
    assert serving.phase == "serving" and serving.overdue_s(now=serving.time) < 0
    assert stuck.phase == "engine core not answering for 0s" and stuck.overdue_s(now=stuck.time) >= 0
    assert dead.phase == "engine errored" and dead.overdue_s(now=dead.time) >= 0


@pytest.mark.chaos
def test_a_random_bytes_weight_file_is_refused_naming_the_file_the_check_and_the_serving_version(tmp_path):
    """Probe: the reply was "OverflowError: cannot fit 'int' into an index-sized integer" with weight_version=0
    while version 27 served."""
    import random

    good, bad = _step(tmp_path, 27), _step(tmp_path, 28)
    (tmp_path / "step_28" / "model.safetensors").write_bytes(random.Random(0).randbytes(4096))
    engine = FakeEngine()
    controller = _controller(engine, model_dir="/model")

    async def run():
        assert (await controller.handle(LoadWeightsRequest(path=good, version=27), "10.0.0.7")).ok
        engine.calls.clear()
        return await controller.handle(LoadWeightsRequest(path=bad, version=28), "10.0.0.7")

    reply = asyncio.run(run())
    assert not reply.ok and reply.weight_version == 27
    assert f"{bad}/model.safetensors is not a safetensors file" in reply.error
    assert "(check: header length <= file size - 8)" in reply.error and "version 27 serves on" in reply.error
    assert engine.calls == []  # refused before any worker saw it
