"""ipc across the nodes of a colocated SLURM job, without vLLM or SLURM: gloo ranks as 2 nodes of 1 or 2 ranks
(LOCAL_WORLD_SIZE), publish through the real ``IpcPublisher`` into one stand-in server per node (the real
controller, asleep as after rollouts; its "workers" read the slots with the real ``IpcReceiver``). Each node's
leader wakes and fills its own node's server only, on its own channel, and the version is announced only once
every node's server serves it; a node whose server fails the version is an error on every rank, and nothing
is announced. On the local SLURM cluster with vLLM: tests/slurm/test_slurm_cluster.py.

Cross-package (trainer publisher, inference controller), so it lives in the root tests/."""

from __future__ import annotations

import asyncio
import os
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from packages.inference.tests.test_sleep import SleepyEngine  # noqa: E402
from prime_rl.common.net import free_port  # noqa: E402
from prime_rl.common.weight_sync.broadcast import BucketLayout  # noqa: E402
from prime_rl.common.wire import SleepRequest, decode  # noqa: E402
from prime_rl.inference.control import Controller, ControlThread  # noqa: E402
from prime_rl.inference.weights.ipc_receiver import IpcReceiver  # noqa: E402
from prime_rl.inference.weights.manifest import Manifest, Spec  # noqa: E402
from prime_rl.trainer.testing import run_on_ranks  # noqa: E402

pytestmark = pytest.mark.multiprocess  # several processes: the dev-venv suite runs them

WEIGHT = torch.arange(16, dtype=torch.float32).reshape(4, 4)
"""The model: one tensor, WEIGHT + v at version v."""


class SlotReader(SleepyEngine):
    """One stand-in server's workers: each version is read from the trainer's slots as a vLLM worker reads it,
    taking ``load_s`` more (a slower node), or failing with ``fail``."""

    def __init__(self, load_s: float = 0.0, fail: str | None = None) -> None:
        super().__init__(sleep_mode=True)
        self.load_s, self.fail = load_s, fail
        self.receiver: IpcReceiver | None = None
        self.channels: list[tuple[str, int]] = []
        """The bucket channel of each session opened: whose push this server reads."""
        self.loaded: dict[int, tuple[float, torch.Tensor]] = {}
        """Version -> (when its load ended, the weight read)."""

    async def collective_rpc(self, method, args=()):
        if method == "prime_init_ipc":
            request = decode(args[0])
            self.receiver = await asyncio.to_thread(IpcReceiver, request)
            self.channels.append((request.host, request.port))
            return [{"worker_id": self.receiver.worker_id}]
        assert method == "prime_receive_ipc", method
        return [await asyncio.to_thread(self._receive, *args)]

    def _receive(self, names, dtypes, shapes, buckets, offsets, bucket_sizes, version, served) -> dict:
        layout = BucketLayout.from_fields(names, dtypes, shapes, buckets, offsets, bucket_sizes)
        got = {name: t.clone() for batch in self.receiver.batches(layout, version) for name, t in batch}
        time.sleep(self.load_s)
        if self.fail is not None:
            raise RuntimeError(self.fail)
        self.loaded[version] = (time.time(), got["w"])
        return {"tensors": len(got)}


def _serve(engines: list[SlotReader], loop: asyncio.AbstractEventLoop) -> list[ControlThread]:
    """One control plane per node's server, put to sleep by the orchestrator as after a step's rollouts."""
    threads = []
    for engine in engines:
        controller = Controller(engine, Manifest(expected={"w": Spec("float32", (4, 4))}, optional={}), model_name="m")
        threads.append(ControlThread(f"tcp://127.0.0.1:{free_port()}", controller, loop).start())
        sleep = SleepRequest(level=1, by="orchestrator")
        asyncio.run_coroutine_threadsafe(controller.handle(sleep, "orch"), loop).result()
    return threads


def _node(addresses: list[str], port: int, versions: int) -> tuple[list[tuple[int, float]], str | None]:
    """One rank: publishes ``versions`` versions as the colocated trainer does (every rank frees its step's memory
    first; its node's local rank 0 pushes). Rank 0's announcements (version, when), and what it raised."""
    from prime_rl.common.config.rl_trainer import IpcBroadcastConfig
    from prime_rl.trainer.rl import publish_base, publish_ipc
    from prime_rl.trainer.world import World

    weight = WEIGHT.clone()
    publish_base.publish_state = lambda model: {"w": weight}  # the model's state (no FSDP: one tensor, full)
    publish_ipc.model_state_dict_to_hf = lambda tensors, config: tensors
    env = {k: int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    world = World(
        rank=env["RANK"], local_rank=env["LOCAL_RANK"], world_size=env["WORLD_SIZE"], device=torch.device("cpu"),
        local_world_size=env["LOCAL_WORLD_SIZE"],
    )  # fmt: skip
    cfg = IpcBroadcastConfig(memory="host", dtype="float32", port=port, inference_addresses=addresses, timeout=30)
    model = SimpleNamespace(config=None, model=SimpleNamespace())
    publisher = publish_ipc.IpcPublisher(cfg, None, model, world, make_room=lambda: None)
    announced: list[tuple[int, float]] = []
    if publisher.announcer is not None:
        publisher.announcer = SimpleNamespace(announce=lambda version, **kw: announced.append((version, time.time())))
    error = None
    try:
        for version in range(1, versions + 1):
            weight.add_(1)
            publisher.publish(version)
        publisher.flush()
    except Exception as e:  # noqa: BLE001 - every rank's error is the test's
        error = f"{type(e).__name__}: {e}"
    if publisher.sender is not None:  # a node's leader
        publisher.sender.close()
    return announced, error


@pytest.mark.parametrize("ranks_per_node", [1, 2], ids=["2x1", "2x2"])
def test_each_node_pushes_into_its_own_server_and_the_version_is_announced_once_every_node_serves_it(
    loop, ranks_per_node
):
    engines = [SlotReader(), SlotReader(load_s=1.0)]  # node 1's server loads a second later
    threads = _serve(engines, loop)
    port = free_port(headroom=8)  # node i's bucket channel is port + i
    try:
        results = run_on_ranks(
            _node, 2 * ranks_per_node, [t.endpoint for t in threads], port, 2, ranks_per_node=ranks_per_node
        )
    finally:
        for thread in threads:
            thread.stop()
    announced = results[0][0]
    assert [error for _, error in results] == [None] * len(results)
    assert all(a == [] for a, _ in results[1:])  # rank 0 alone announces
    # each server read its own node's channel only: node i's leader on loopback at port + i
    assert [engine.channels for engine in engines] == [[("127.0.0.1", port)], [("127.0.0.1", port + 1)]]
    for engine in engines:
        assert sorted(engine.loaded) == [1, 2]
        assert all(torch.equal(engine.loaded[v][1], WEIGHT + v) for v in (1, 2))
        # its own leader woke its weights before version 1 (version 2 found them awake); the KV cache sleeps
        assert engine.calls.count(("wake_up", ("weights",))) == 1 and engine.asleep
    assert [version for version, _ in announced] == [1, 2]
    for version, when in announced:  # not before the slower node serves it
        assert when > max(engine.loaded[version][0] for engine in engines), version


def test_a_node_whose_server_fails_the_version_stops_every_rank_and_nothing_is_announced(loop):
    engines = [SlotReader(), SlotReader(fail="NaN in model.layers.0.mlp")]
    threads = _serve(engines, loop)
    try:
        results = run_on_ranks(_node, 2, [t.endpoint for t in threads], free_port(headroom=8), 1, ranks_per_node=1)
    finally:
        for thread in threads:
            thread.stop()
    (announced, error0), (_, error1) = results
    assert announced == []
    assert 1 in engines[0].loaded  # node 0's server serves it, but the run does not move to it
    for error in (error0, error1):  # the same verdict on both nodes, naming the failed one and its reason
        assert error is not None and error.startswith(
            "RuntimeError: ipc weight update to version 1 failed on 1 of 2 nodes (node 1: IpcWeightError:"
        ), error
        assert "NaN in model.layers.0.mlp" in error
