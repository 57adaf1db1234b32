"""NIXL weight transport without vLLM: trainer ranks and receivers as separate CPU processes (UCX, DRAM).

The receivers are the inference package's ``NixlReceiver`` (what every vLLM worker runs) with a
plain "load" that collects tensors; the senders are the trainer package's ``NixlWeightSender``.
The vLLM end to end lives in tests/test_server_nixl.py; the receiver's own checks in
packages/inference/tests/test_nixl_receiver.py.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from prime_rl.common.net import free_port
from prime_rl.common.nixl_layout import (
    ALIGNMENT,
    NixlProtocolError,
    pieces_in_range,
    plan_layout,
    read_order,
    source_slices,
)
from prime_rl.common.nixl_metadata import MetadataClient, MetadataService
from prime_rl.common.wire import TensorSpec

pytest.importorskip("nixl_cu13", reason="needs the nixl extra (nixl-cu13)")

TIMEOUT = 30


def state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(300, 64, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.randn(64, generator=g),
        "layers.0.proj.weight": torch.randn(64, 129, generator=g).to(torch.bfloat16),
        "layers.1.proj.weight": torch.randn(500, 64, generator=g),
        "head.bias": torch.randn(7, generator=g).to(torch.float16),
        "step": torch.tensor([seed], dtype=torch.int64),
    }


def specs_of(sd: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(name=k, dtype=str(v.dtype).removeprefix("torch."), shape=list(v.shape)) for k, v in sd.items()]


# -- layout arithmetic (pure Python) ---------------------------------------------------------------


def test_layout_slices_cover_every_byte_once():
    specs = specs_of(state_dict(0))
    layout = plan_layout(specs, num_sources=3, group_bytes=40_000, num_slots=2)
    assert len(layout.group_sizes) > 2 and layout.groups == sorted(layout.groups)
    assert all(off % ALIGNMENT == 0 for off in layout.offsets)
    for g, size in enumerate(layout.group_sizes):
        slices = source_slices(size, 3)
        assert slices[0][0] == 0 and slices[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
        assert all(s % ALIGNMENT == 0 for s, e in slices if e > s)
        covered = sum(p.tensor_end - p.tensor_start for s, e in slices for p in pieces_in_range(layout, g, s, e))
        tensors = [i for i, gi in enumerate(layout.groups) if gi == g]
        assert covered == sum(
            torch.empty(0, dtype=getattr(torch, specs[i].dtype)).element_size() * torch.Size(specs[i].shape).numel()
            for i in tensors
        )
    # every receiver starts at another trainer rank
    assert [read_order(r, 4)[0] for r in range(4)] == [0, 1, 2, 3]


# -- processes ---------------------------------------------------------------------------------------


def _trainer(rank, world, port, session, overlap, versions, linked, out):
    from prime_rl.trainer.weights.nixl_source import NixlWeightSender

    sender = NixlWeightSender(
        [],
        host="127.0.0.1",
        port=port,
        rank=rank,
        world_size=world,
        session=session,
        group_bytes=40_000,
        overlap=overlap,
        timeout_s=TIMEOUT,
        start_service=False,
    )
    try:
        sender.prepare(specs_of(state_dict(0)))
        linked.wait(TIMEOUT)  # the receivers have registered (a server's InitNixlRequest in real runs)
        sender.link()
        for v in versions:
            sender.source.publish(v, sender._tensors_in_layout(state_dict(v).items()))
        out.put(("trainer", rank, "ok"))
    except Exception as e:
        out.put(("trainer", rank, f"{type(e).__name__}: {e}"))
    finally:
        sender.close()


def _receiver(rank, port, session, versions, registered, out):
    from prime_rl.inference.weights.nixl_receiver import NixlReceiver

    client = MetadataClient("127.0.0.1", port)
    receiver = NixlReceiver(client, session, rank, device=torch.device("cpu"), timeout_s=TIMEOUT)
    registered.put(rank)
    try:
        for v in versions:
            got: dict[str, torch.Tensor] = {}
            receiver.receive(v, lambda batch, got=got: got.update({n: t.clone() for n, t in batch}))
            expected = state_dict(v)
            ok = got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
            rolled = dict(kv for batch in receiver.rollback_batches() for kv in batch)
            ok = ok and all(torch.equal(rolled[k], expected[k]) for k in expected)
            out.put(("receiver", rank, v, ok))
        try:
            receiver.receive(versions[-1], lambda batch: None)
        except NixlProtocolError as e:
            out.put(("receiver", rank, "refused", str(e)))
    finally:
        receiver.close()
        client.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_two_trainer_ranks_two_receivers(overlap, monkeypatch):
    # Spawned children import this module as tests.test_nixl_transfer: give them the repo root.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    service = MetadataService("127.0.0.1", free_port()).start()
    ctx = mp.get_context("spawn")
    out, registered, linked = ctx.Queue(), ctx.Queue(), ctx.Event()
    session, versions = f"test-{overlap}", [1, 2, 3]
    procs = [
        ctx.Process(target=_trainer, args=(r, 2, service.port, session, overlap, versions, linked, out)) for r in (0, 1)
    ]
    procs += [ctx.Process(target=_receiver, args=(r, service.port, session, versions, registered, out)) for r in (0, 1)]
    try:
        for p in procs:
            p.start()
        for _ in range(2):
            registered.get(timeout=TIMEOUT)
        linked.set()
        results = [out.get(timeout=TIMEOUT) for _ in range(2 + 2 * len(versions) + 2)]
    finally:
        for p in procs:
            p.join(timeout=TIMEOUT)
            if p.exitcode is None:
                p.kill()
        service.stop()
    assert sorted(r for r in results if r[0] == "trainer") == [("trainer", 0, "ok"), ("trainer", 1, "ok")], results
    received = sorted(r for r in results if r[0] == "receiver" and r[2] != "refused")
    assert received == [("receiver", r, v, True) for r in (0, 1) for v in versions], results
    refused = [r for r in results if r[2] == "refused"]
    assert len(refused) == 2 and all("already received" in r[3] for r in refused)


def test_metadata_service_and_config():
    from prime_rl.common.config.rl_trainer import NixlBroadcastConfig, RLTrainerConfig
    from prime_rl.common.nixl_metadata import is_serving

    service = MetadataService("127.0.0.1", free_port()).start()
    client = MetadataClient("127.0.0.1", service.port, timeout_s=5)
    try:
        assert is_serving("127.0.0.1", service.port)
        client.put("s/infer/b", b"2")
        client.put("s/infer/a", b"1")
        client.put("t/x", b"3")
        assert client.get("s/infer/a") == b"1" and client.get("missing") is None
        assert client.keys("s/infer/") == ["s/infer/a", "s/infer/b"]
        with pytest.raises(TimeoutError, match="did not appear"):
            client.wait_get("s/layout", timeout_s=0.2)
    finally:
        client.close()
        service.stop()
    cfg = RLTrainerConfig.model_validate(
        {"model": {"name": "m"}, "weight_broadcast": {"type": "nixl", "overlap_transfer_and_replay": True}}
    )
    assert isinstance(cfg.weight_broadcast, NixlBroadcastConfig) and cfg.weight_broadcast.overlap_transfer_and_replay
