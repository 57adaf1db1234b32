"""A push transport's update into a sleeping server (colocated runs with ``[weight_broadcast] type = "ipc"``), with
a recording fake engine: refused while the weights sleep, loaded without resuming generation once the trainer woke
them, and generation resumes only when the KV cache wakes; a failed push rolls back and leaves the server asleep
(the trainer raises and the run stops), saying so in health."""

from __future__ import annotations

import asyncio

import pytest

from packages.inference.tests.test_control_push import _requests, metadata  # noqa: F401 (a fixture)
from packages.inference.tests.test_control_restore import FakeEngine
from prime_rl.common.weight_transports import TRANSPORTS
from prime_rl.common.wire import HealthRequest, Message, SleepRequest, WakeUpRequest
from prime_rl.inference.control import Controller
from prime_rl.inference.weights.manifest import Manifest, Spec

PUSHED = [name for name, t in TRANSPORTS.items() if t.loads == "trainer"]


class FailingReceive(FakeEngine):
    async def collective_rpc(self, method, args=()):
        if method.startswith("prime_receive"):
            self.calls.append((method,))
            raise RuntimeError("bucket 0 carries NaN")
        return await super().collective_rpc(method, args)


def _controller(engine: FakeEngine) -> Controller:
    return Controller(engine, Manifest(expected={"w": Spec("float32", (4, 4))}, optional={}), model_name="m")


def _run(controller: Controller, requests: list[Message]) -> list:
    async def run():
        return [await controller.handle(r, "10.0.0.7") for r in requests]

    return asyncio.run(run())


def _push(transport: str, version: int, port: int) -> list[Message]:
    table, requests = TRANSPORTS[transport], _requests(transport, version, port)
    return [requests[kind] for kind in table.setup + table.update]


@pytest.mark.parametrize("transport", PUSHED)
def test_a_push_into_sleeping_weights_is_refused_naming_the_wake_up(transport, metadata):  # noqa: F811
    engine = FakeEngine()
    controller = _controller(engine)
    replies = _run(controller, [SleepRequest(level=1, by="orchestrator"), *_push(transport, 3, metadata.port)])
    begin = replies[1 + len(TRANSPORTS[transport].setup)]
    assert not begin.ok and "WakeUpRequest(tags=['weights']) first" in begin.error, begin.error
    assert "put to sleep by orchestrator@10.0.0.7" in begin.error and begin.weight_version == 0
    assert not any(call[0].startswith("prime_receive") for call in engine.calls)


@pytest.mark.parametrize("transport", PUSHED)
def test_the_colocated_push_order_resumes_generation_only_once_the_kv_cache_wakes(transport, metadata):  # noqa: F811
    engine = FakeEngine()
    controller = _controller(engine)
    sleep, wake_weights = SleepRequest(level=1, by="orchestrator"), WakeUpRequest(tags=["weights"], by="trainer")
    replies = _run(controller, [sleep, wake_weights, *_push(transport, 3, metadata.port)])
    assert all(r.ok for r in replies), [r.error for r in replies]
    assert replies[-1].weight_version == 3
    assert ("resume",) not in engine.calls  # the update did not resume an engine whose KV cache sleeps
    health = _run(controller, [HealthRequest()])[0]
    assert health.sleeping and health.awake == ["weights"]
    _run(controller, [WakeUpRequest(tags=["kv_cache"], by="orchestrator")])
    assert engine.calls[-2:] == [("reset_prefix_cache",), ("resume",)]
    assert not _run(controller, [HealthRequest()])[0].sleeping


def test_a_failed_push_into_woken_weights_rolls_back_and_stays_asleep():
    engine = FailingReceive()
    controller = _controller(engine)
    controller._restore_path = "/models/m"  # the first update: what served is reloaded from the model directory
    sleep, wake_weights = SleepRequest(level=1, by="orchestrator"), WakeUpRequest(tags=["weights"], by="trainer")
    replies = _run(controller, [sleep, wake_weights, *_push("ipc", 1, 29999)])
    assert not replies[-1].ok and "bucket 0 carries NaN" in replies[-1].error
    assert replies[-1].weight_version == 0  # the previous version serves (reloaded), nothing half-loaded
    assert ("prime_load_checkpoint", "/models/m") in engine.calls
    assert ("resume",) not in engine.calls  # still asleep: the trainer raises and the run stops
    health = _run(controller, [HealthRequest()])[0]
    assert health.sleeping and health.awake == ["weights"] and health.ok
