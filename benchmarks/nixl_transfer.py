"""NIXL weight transfer vs filesystem and gloo broadcast on CPU; prints one JSON object.

    python benchmarks/nixl_transfer.py            # both parts
    python benchmarks/nixl_transfer.py tiny       # tiny model into a real vLLM CPU server
    python benchmarks/nixl_transfer.py synthetic  # 1 GiB synthetic bf16 state dict, process to process

tiny: every update is the full server-side sequence (validate, pause, transfer, layerwise reload,
prefix-cache reset, set version, resume), timed as the trainer sees it; median of ``ITERS``.

synthetic: a trainer-like process and a receiver process, no vLLM; the receiver's "load" is a no-op,
so the numbers are the wire part (stage/pack + transfer + views). NIXL runs the production classes
(``NixlWeightSender`` / ``NixlReceiver``, UCX over loopback, host memory); gloo runs the broadcast
transport's ``send_buckets`` / ``receive_buckets``; filesystem writes safetensors to /tmp and reads
them back in the receiver (page cache: this is the best case for the filesystem).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for pkg in ("common", "trainer", "inference"):
    sys.path.insert(0, str(ROOT / "packages" / pkg / "src"))

import torch  # noqa: E402

from prime_rl.common.net import free_port  # noqa: E402

ITERS = 5
SYNTH_TENSORS, SYNTH_SHAPE = 32, (4096, 4096)  # 32 x 32 MiB bf16 = 1 GiB
GROUP_BYTES = 256 << 20


def median(xs: list[float]) -> float:
    return statistics.median(xs)


# -- tiny model into vLLM ---------------------------------------------------------------------------


def bench_tiny(iters: int = ITERS) -> dict:
    from safetensors.torch import load_file, save_file

    from prime_rl.common.testing import make_tiny_model
    from prime_rl.common.transport import ControlClient
    from prime_rl.common.wire import LoadWeightsRequest
    from prime_rl.inference.testing import start_server, stop_server
    from prime_rl.trainer.weights.broadcast_sender import WeightBroadcaster
    from prime_rl.trainer.weights.nixl_source import NixlWeightSender

    tmp = Path(tempfile.mkdtemp(prefix="nixl-bench-"))
    model = make_tiny_model(tmp / "tiny", dtype="float32", tie_word_embeddings=True)
    server = start_server(tmp, model)  # returns once control plane and HTTP answer
    endpoint = server.control
    result: dict = {}
    try:
        sd = load_file(model / "model.safetensors")
        total = sum(t.numel() * t.element_size() for t in sd.values())
        result["model"] = {"tensors": len(sd), "bytes": total, "dtype": "float32"}

        fs = []
        with ControlClient(endpoint, timeout_s=120) as c:
            for step in range(1, iters + 1):
                out = tmp / "broadcasts" / f"step_{step}"
                out.mkdir(parents=True)
                start = time.perf_counter()
                save_file(sd, out / "model.safetensors")
                (out / "STABLE").touch()
                reply = c.request(LoadWeightsRequest(path=str(out), version=step))
                fs.append(time.perf_counter() - start)
                assert reply.ok, reply.error
        result["filesystem_s"] = median(fs)

        b = WeightBroadcaster([endpoint], host="127.0.0.1", port=free_port(), backend="gloo", timeout_s=120)
        b.connect()
        gloo = []
        for step in range(iters):
            start = time.perf_counter()
            b.push(100 + step, sd.items())
            gloo.append(time.perf_counter() - start)
        b.close()
        result["gloo_broadcast_s"] = median(gloo)

        runs = (
            ("nixl", GROUP_BYTES, False),
            ("nixl_5_groups", 512 << 10, False),
            ("nixl_5_groups_overlap", 512 << 10, True),
        )
        for n, (key, group_bytes, overlap) in enumerate(runs):
            base = 200 + 100 * n
            sender = NixlWeightSender(
                [endpoint], host="127.0.0.1", port=free_port(), group_bytes=group_bytes, overlap=overlap, timeout_s=120
            )
            start = time.perf_counter()
            sender.push(base, sd.items())  # first push sets the session up
            first = time.perf_counter() - start
            times = [sender.push(base + 1 + i, sd.items()) for i in range(iters)]
            result[key] = {
                "setup_and_first_s": first,
                "update_s": median(times),
                "groups": len(sender.layout.group_sizes),
            }
            sender.close()
    finally:
        stop_server(server.proc)
    return result


# -- synthetic 1 GiB, process to process ----------------------------------------------------------------


def synthetic_state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        f"layers.{i}.weight": torch.randint(-1000, 1000, SYNTH_SHAPE, generator=g, dtype=torch.int16).view(
            torch.bfloat16
        )
        for i in range(SYNTH_TENSORS)
    }


def checksum(tensors) -> float:
    return float(sum(t.view(torch.int16).double().sum().item() for t in tensors))


def _nixl_sender(port: int, session: str, overlap: bool, versions: list[int], linked, out) -> None:
    from prime_rl.common.wire import TensorSpec
    from prime_rl.trainer.weights.nixl_source import NixlWeightSender

    sd = synthetic_state(0)
    sender = NixlWeightSender(
        [],
        host="127.0.0.1",
        port=port,
        session=session,
        group_bytes=GROUP_BYTES,
        overlap=overlap,
        timeout_s=300,
        start_service=False,
    )
    specs = [TensorSpec(name=k, dtype="bfloat16", shape=list(v.shape)) for k, v in sd.items()]
    sender.prepare(specs)
    linked.wait(300)
    sender.link()
    tensors = sender._tensors_in_layout(sd.items())
    times = []
    for v in versions:
        start = time.perf_counter()
        sender.source.publish(v, tensors)
        times.append(time.perf_counter() - start)
    out.put(("sender", times, checksum(tensors)))
    sender.close()


def _nixl_receiver(port: int, session: str, versions: list[int], registered, out) -> None:
    from prime_rl.common.nixl_metadata import MetadataClient
    from prime_rl.inference.weights.nixl_receiver import NixlReceiver

    client = MetadataClient("127.0.0.1", port)
    receiver = NixlReceiver(client, session, 0, device=torch.device("cpu"), keep_rollback_copy=False, timeout_s=300)
    registered.put(0)
    times, last = [], []
    for v in versions:
        got: list[torch.Tensor] = []
        start = time.perf_counter()
        receiver.receive(v, lambda batch, got=got: got.extend(t.clone() for _, t in batch))
        times.append(time.perf_counter() - start)
        last = got
    out.put(("receiver", times, checksum(last)))
    receiver.close()
    client.close()


def bench_nixl_synthetic(overlap: bool, iters: int) -> dict:
    import multiprocessing as mp

    from prime_rl.common.nixl_metadata import MetadataService

    service = MetadataService("127.0.0.1", free_port()).start()
    ctx = mp.get_context("spawn")
    out, registered, linked = ctx.Queue(), ctx.Queue(), ctx.Event()
    versions = list(range(1, iters + 2))  # first one is warm-up (connection set-up)
    session = f"bench-{overlap}"
    procs = [
        ctx.Process(target=_nixl_sender, args=(service.port, session, overlap, versions, linked, out)),
        ctx.Process(target=_nixl_receiver, args=(service.port, session, versions, registered, out)),
    ]
    for p in procs:
        p.start()
    registered.get(timeout=300)
    linked.set()
    results = dict((kind, (times, csum)) for kind, times, csum in (out.get(timeout=600) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    service.stop()
    recv_times = results["receiver"][0][1:]
    return {
        "update_s": median(recv_times),
        "sender_publish_s": median(results["sender"][0][1:]),
        "bytes_match": results["receiver"][1] == results["sender"][1],
    }


def _gloo_rank(rank: int, port: int, iters: int, out) -> None:
    from prime_rl.common.weight_sync.broadcast import Spec, build_weight_group, plan_buckets
    from prime_rl.inference.weights.broadcast_receiver import receive_buckets
    from prime_rl.trainer.weights.broadcast_sender import send_buckets

    group = build_weight_group("127.0.0.1", port, rank, 2, "gloo", 300)
    sd = synthetic_state(0)
    specs = [Spec(k, "bfloat16", tuple(v.shape)) for k, v in sd.items()]
    layout = plan_buckets(specs, GROUP_BYTES)
    tensors = list(sd.values())
    times, csum = [], 0.0
    for _ in range(iters + 1):
        group.broadcast(torch.ones(1))  # line both ranks up
        start = time.perf_counter()
        if rank == 0:
            send_buckets(group, layout, tensors)
        else:
            received = receive_buckets(group, layout)
        times.append(time.perf_counter() - start)
    csum = checksum(tensors if rank == 0 else [received[s.name] for s in specs])
    out.put((rank, times[1:], csum))
    group.close()


def bench_gloo_synthetic(iters: int) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, iters, out)) for r in range(2)]
    for p in procs:
        p.start()
    res = dict((r, (t, c)) for r, t, c in (out.get(timeout=600) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    return {
        "update_s": max(median(res[0][0]), median(res[1][0])),
        "bytes_match": res[0][1] == res[1][1],
    }


def bench_fs_synthetic(iters: int) -> dict:
    from safetensors.torch import load_file, save_file

    sd = synthetic_state(0)
    tmp = Path(tempfile.mkdtemp(prefix="nixl-bench-fs-"))
    write, read = [], []
    for i in range(iters + 1):
        path = tmp / f"step_{i}.safetensors"
        start = time.perf_counter()
        save_file(sd, path)
        os.sync()
        write.append(time.perf_counter() - start)
        start = time.perf_counter()
        loaded = load_file(path)
        read.append(time.perf_counter() - start)
        path.unlink()
    ok = checksum(loaded.values()) == checksum(sd.values())
    return {
        "update_s": median(write[1:]) + median(read[1:]),
        "write_s": median(write[1:]),
        "read_s": median(read[1:]),
        "bytes_match": ok,
    }


def bench_synthetic(iters: int = 3) -> dict:
    total = SYNTH_TENSORS * SYNTH_SHAPE[0] * SYNTH_SHAPE[1] * 2
    out: dict = {
        "state_dict": {"tensors": SYNTH_TENSORS, "bytes": total, "dtype": "bfloat16"},
        "group_bytes": GROUP_BYTES,
    }
    out["filesystem"] = bench_fs_synthetic(iters)
    out["gloo_broadcast"] = bench_gloo_synthetic(iters)
    out["nixl"] = bench_nixl_synthetic(False, iters)
    out["nixl_overlap"] = bench_nixl_synthetic(True, iters)
    for key in ("filesystem", "gloo_broadcast", "nixl", "nixl_overlap"):
        out[key]["GB_per_s"] = total / out[key]["update_s"] / 1e9
    return out


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "all"
    result = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "torch": torch.__version__}
    if mode in ("all", "tiny"):
        result["tiny_vllm"] = bench_tiny()
    if mode in ("all", "synthetic"):
        result["synthetic_1GiB"] = bench_synthetic()
    print(json.dumps(result, indent=2))
