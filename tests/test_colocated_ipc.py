"""Colocated runs with the ipc transport, trainer against inference control planes (no vLLM): the trainer's sender
wakes every sleeping server's weights as "trainer" (its KV cache stays asleep for the orchestrator to wake), and a
server that cannot wake stops the publish naming it.

Cross-package (trainer sender, inference controller), so it lives in the root tests/."""

from __future__ import annotations

import asyncio
import logging

import pytest

torch = pytest.importorskip("torch")

from packages.inference.tests.test_sleep import SleepyEngine  # noqa: E402
from prime_rl.common.net import free_port  # noqa: E402
from prime_rl.common.wire import SleepRequest  # noqa: E402
from prime_rl.inference.control import Controller, ControlThread  # noqa: E402
from prime_rl.inference.weights.manifest import Manifest  # noqa: E402
from prime_rl.trainer.weights.ipc_sender import IpcWeightError, IpcWeightSender  # noqa: E402


class BrokenWake(SleepyEngine):
    async def wake_up(self, tags):
        raise RuntimeError("cuMemMap failed: out of memory")


def _serve(engine: SleepyEngine, loop: asyncio.AbstractEventLoop) -> tuple[Controller, ControlThread]:
    """A controller behind its control socket, put to sleep by the orchestrator as after a step's rollouts."""
    controller = Controller(engine, Manifest(expected={}, optional={}), model_name="m")
    thread = ControlThread(f"tcp://127.0.0.1:{free_port()}", controller, loop).start()
    asyncio.run_coroutine_threadsafe(controller.handle(SleepRequest(level=1, by="orchestrator"), "orch"), loop).result()
    return controller, thread


def _sender(endpoints: list[str]) -> IpcWeightSender:
    return IpcWeightSender(
        endpoints, host="127.0.0.1", port=free_port(), memory="host", device=torch.device("cpu"), timeout_s=10
    )


def test_the_trainer_wakes_the_weights_of_every_server_and_leaves_the_kv_cache_asleep(loop, caplog):
    served = [_serve(SleepyEngine(sleep_mode=True), loop) for _ in range(2)]
    sender = _sender([thread.endpoint for _, thread in served])
    try:
        with caplog.at_level(logging.INFO, logger="prime_rl.inference"):
            sender.wake_weights()
        for controller, _ in served:
            assert controller.sleep_state.awake_list() == ["weights"] and controller.sleep_state.sleeping
            assert controller.engine.calls[-1] == ("wake_up", ("weights",))
            assert ("resume",) not in controller.engine.calls  # generation waits for the KV cache
        assert caplog.text.count("woke weights for trainer@") == 2  # logged with its origin
    finally:
        sender.close()
        for _, thread in served:
            thread.stop()


def test_a_server_that_cannot_wake_stops_the_publish_naming_it(loop):
    (_, good), (broken, bad) = _serve(SleepyEngine(sleep_mode=True), loop), _serve(BrokenWake(sleep_mode=True), loop)
    sender = _sender([good.endpoint, bad.endpoint])
    try:
        with pytest.raises(IpcWeightError, match=f"WakeUpRequest refused by inference server {bad.endpoint}.*"
                           "cuMemMap failed"):  # fmt: skip
            sender.wake_weights()
        assert broken.sleep_state.sleeping and broken.sleep_state.awake_list() == []
    finally:
        sender.close()
        good.stop()
        bad.stop()
