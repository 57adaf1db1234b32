"""The broadcast transport's two ends over gloo, 3 processes and no vLLM: the trainer's sender
(``prime_rl.trainer.weights.broadcast_sender``), a plain receiver and a receiver using the inference worker's
bucket-by-bucket path (``prime_rl.inference.weights.broadcast_receiver``). Bit-exact for every receiver."""

from __future__ import annotations

import multiprocessing as mp
import socket

import torch

from prime_rl.common.weight_sync.broadcast import Spec, build_weight_group, plan_buckets
from prime_rl.inference.weights.broadcast_receiver import receive_batches, receive_buckets
from prime_rl.trainer.weights.broadcast_sender import send_buckets


def _state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(50, 16, generator=g).to(torch.bfloat16),
        "odd": torch.randn(3, 5, generator=g),  # 60 bytes: the next tensor must be re-aligned
        "big": torch.randn(300, 40, generator=g),  # 48000 bytes > bucket: a bucket of its own
        "norm": torch.randn(7, generator=g).to(torch.float16),
        "ids": torch.arange(11, dtype=torch.int64),
    }


def _rank(rank: int, port: int, out) -> None:
    sd = _state_dict()
    layout = plan_buckets([Spec.of(n, t) for n, t in sd.items()], bucket_bytes=4096)
    group = build_weight_group("127.0.0.1", port, rank, 3, "gloo", 60)
    if rank == 0:
        send_buckets(group, layout, list(sd.values()))
    else:
        if rank == 1:
            got = receive_buckets(group, layout)
        else:  # what an inference worker does: load each bucket as it arrives
            got = {n: t.clone() for batch in receive_batches(group, layout) for n, t in batch}
        out.put(all(got[n].dtype == t.dtype and torch.equal(got[n], t) for n, t in sd.items()))
    group.close()


def test_gloo_round_trip_is_bit_exact_for_every_receiver():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork, not spawn: under pytest's importlib mode a spawned child cannot re-import this test module
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert [out.get(timeout=5), out.get(timeout=5)] == [True, True]
