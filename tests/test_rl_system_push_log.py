"""`benchmarks/rl_system.py` splits a colocated push from the inference server's log: the line the server writes
when a pushed version serves must carry the workers' statistics and the engine's steps in a form the benchmark
reads back (a format drift would silently drop the split the next GPU session depends on)."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import pytest

from packages.inference.tests.test_control_restore import FakeEngine
from prime_rl.common.wire import AwaitWeightsRequest, InitIpcRequest, IpcSlot, IpcWeightsRequest, TensorSpec
from prime_rl.inference.control import Controller
from prime_rl.inference.weights.manifest import Manifest, Spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
rl_system = pytest.importorskip("rl_system")


def test_the_benchmark_reads_the_push_line_the_server_writes(caplog):
    engine = FakeEngine()
    controller = Controller(engine, Manifest(expected={"w": Spec("float32", (4, 4))}, optional={}), model_name="m")
    spec = TensorSpec(name="w", dtype="float32", shape=[4, 4])
    requests = [
        InitIpcRequest(host="127.0.0.1", port=1, session="s", memory="host", slots=[IpcSlot(size=64, path="/x")]),
        IpcWeightsRequest(version=2, specs=[spec], buckets=[0], offsets=[0], bucket_sizes=[64]),
        AwaitWeightsRequest(version=2),
    ]

    async def run():
        return [await controller.handle(r, "127.0.0.1") for r in requests]

    with caplog.at_level(logging.INFO, logger="prime_rl.inference"):
        assert all(reply.ok for reply in asyncio.run(run()))
    pushes = rl_system.parse_pushes(caplog.text)
    assert list(pushes) == [2]
    first = pushes[2][0]
    assert first["tensors"] == 1  # the fake workers' statistics
    assert set(first["engine"]) == {"pause_s", "workers_s", "reset_cache_s", "label_s", "resume_s", "awaited_s"}
