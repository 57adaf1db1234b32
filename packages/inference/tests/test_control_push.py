"""The controller's side of the push transports (nccl, nixl, ipc) with a recording fake engine (no vLLM, no torch):
each transport's control requests from the lifecycle table (``prime_rl.common.weight_transports``) run in the
workers in order and tag the version, and each transport's version rule is the one the table states."""

from __future__ import annotations

import asyncio

import pytest

from packages.inference.tests.test_control_restore import FakeEngine
from prime_rl.common.net import free_port
from prime_rl.common.nixl_layout import plan_layout
from prime_rl.common.nixl_metadata import MetadataClient, MetadataService
from prime_rl.common.weight_transports import TRANSPORTS
from prime_rl.common.wire import (
    AwaitWeightsRequest,
    BroadcastWeightsRequest,
    InitBroadcastRequest,
    InitIpcRequest,
    InitNixlRequest,
    IpcSlot,
    IpcWeightsRequest,
    Message,
    NixlWeightsRequest,
    TensorSpec,
)
from prime_rl.inference.control import Controller
from prime_rl.inference.weights.manifest import Manifest, Spec

SPEC = TensorSpec(name="w", dtype="float32", shape=[4, 4])
PUSHED = [name for name, t in TRANSPORTS.items() if t.loads == "trainer"]


@pytest.fixture
def metadata():
    """A NIXL metadata service holding one session's layout (what trainer rank 0 stores before InitNixlRequest)."""
    service = MetadataService("127.0.0.1", free_port()).start()
    client = MetadataClient("127.0.0.1", service.port, timeout_s=5)
    client.put("s/layout", plan_layout([SPEC], num_sources=1, group_bytes=1 << 10))
    client.close()
    yield service
    service.stop()


def _requests(transport: str, version: int, port: int) -> dict[type[Message], Message]:
    """One request of every type the table lists for ``transport``, for ``version``."""
    if transport == "nccl":
        setup = InitBroadcastRequest(host="127.0.0.1", port=port, world_size=2, rank_offset=1, backend="gloo")
        begin = BroadcastWeightsRequest(version=version, specs=[SPEC], buckets=[0], offsets=[0], bucket_sizes=[64])
    elif transport == "ipc":
        slots = [IpcSlot(size=64, path="/dev/shm/x")]
        setup = InitIpcRequest(host="127.0.0.1", port=port, session="s", memory="host", slots=slots)
        begin = IpcWeightsRequest(version=version, specs=[SPEC], buckets=[0], offsets=[0], bucket_sizes=[64])
    else:
        setup = InitNixlRequest(host="127.0.0.1", port=port, session="s", timeout_s=5)
        begin = NixlWeightsRequest(version=version)
    return {type(setup): setup, type(begin): begin, AwaitWeightsRequest: AwaitWeightsRequest(version=version)}


def _run(controller: Controller, requests: list[Message]) -> list:
    async def run():
        return [await controller.handle(r, "10.0.0.7") for r in requests]

    return asyncio.run(run())


def test_the_table_names_a_push_transport_for_every_request_the_trainer_sends():
    assert sorted(PUSHED) == ["ipc", "nccl", "nixl"]
    assert all(TRANSPORTS[t].update[-1] is AwaitWeightsRequest for t in PUSHED)  # the trainer learns it is served


@pytest.mark.parametrize("transport", PUSHED)
def test_a_push_transport_runs_its_requests_in_the_workers_and_tags_the_version(transport, metadata):
    engine = FakeEngine()
    controller = Controller(engine, Manifest(expected={"w": Spec("float32", (4, 4))}, optional={}), model_name="m")
    table = TRANSPORTS[transport]
    requests = _requests(transport, 3, metadata.port)
    replies = _run(controller, [requests[kind] for kind in table.setup + table.update])
    assert all(r.ok for r in replies), [r.error for r in replies]
    assert replies[-1].weight_version == 3
    methods = [call[0] for call in engine.calls]
    setup_rpc, receive_rpc = {
        "nccl": ("prime_init_broadcast", "prime_receive_broadcast"),
        "ipc": ("prime_init_ipc", "prime_receive_ipc"),
    }.get(transport, ("prime_init_nixl", "prime_receive_nixl"))
    # Set-up runs in the workers without pausing; the update pauses, loads, drops stale KV, tags, resumes.
    assert methods == [setup_rpc, "pause", receive_rpc, "reset_prefix_cache", "version", "resume"], methods
    assert engine.calls[-2] == ("version", "3")
    # each of those steps is timed for the update's log line (what the trainer's wait for a push is made of)
    assert list(controller.last_update_s) == ["pause_s", "workers_s", "reset_cache_s", "label_s", "resume_s"]


@pytest.mark.parametrize("transport", PUSHED)
def test_each_push_transport_applies_the_version_rule_of_the_table(transport, metadata):
    engine = FakeEngine()
    controller = Controller(engine, Manifest(expected={"w": Spec("float32", (4, 4))}, optional={}), model_name="m")
    table = TRANSPORTS[transport]
    first, again = _requests(transport, 3, metadata.port), _requests(transport, 3, metadata.port)
    replies = _run(controller, [first[kind] for kind in table.setup + table.update] + [again[table.update[0]]])
    stale = replies[-1]
    if table.versions_increase:
        assert not stale.ok and "version 3 is served and versions must increase" in stale.error, stale.error
        assert stale.error.startswith(f"refused {transport.upper()} update to version 3")
    else:
        assert stale.ok, stale.error
        assert _run(controller, [AwaitWeightsRequest(version=3)])[0].ok
