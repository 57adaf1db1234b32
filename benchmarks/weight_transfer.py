"""Weight-update time per transport; prints one JSON object.

    python benchmarks/weight_transfer.py cpu   # tiny model on a real vLLM CPU server: filesystem vs gloo broadcast
    python benchmarks/weight_transfer.py gpu   # 2 GPUs, no vLLM: NCCL broadcast of a Qwen3-1.7B-size bf16 state
                                               # dict with the trainer's bucketing code vs GPU-to-GPU copy bandwidth

The gpu mode runs the sender (``send_buckets``) on GPU 0 and the plain-torch receiver (``receive_buckets``)
on GPU 1 over the same group code the inference workers use; it times the wire part of an update (pack +
broadcast + unpack views), not vLLM's load into its parameters.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for pkg in ("common", "trainer", "inference"):
    sys.path.insert(0, str(ROOT / "packages" / pkg / "src"))

import torch  # noqa: E402

from prime_rl.common.net import free_port  # noqa: E402
from prime_rl.common.weight_sync.broadcast import Spec, build_weight_group, plan_buckets  # noqa: E402
from prime_rl.inference.weights.broadcast_receiver import receive_buckets  # noqa: E402
from prime_rl.trainer.weights.broadcast_sender import send_buckets  # noqa: E402

# -- gpu ------------------------------------------------------------------------------------------


def qwen3_1_7b_specs() -> list[Spec]:
    """Qwen3-1.7B's HF state dict (tied embeddings): 28 layers, hidden 2048, 16/8 heads of 128, mlp 6144."""
    h, inter, layers, vocab, hd, nq, nkv = 2048, 6144, 28, 151936, 128, 16, 8
    specs = [Spec("model.embed_tokens.weight", "bfloat16", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [
            Spec(p + "input_layernorm.weight", "bfloat16", (h,)),
            Spec(p + "self_attn.q_proj.weight", "bfloat16", (nq * hd, h)),
            Spec(p + "self_attn.k_proj.weight", "bfloat16", (nkv * hd, h)),
            Spec(p + "self_attn.v_proj.weight", "bfloat16", (nkv * hd, h)),
            Spec(p + "self_attn.o_proj.weight", "bfloat16", (h, nq * hd)),
            Spec(p + "self_attn.q_norm.weight", "bfloat16", (hd,)),
            Spec(p + "self_attn.k_norm.weight", "bfloat16", (hd,)),
            Spec(p + "post_attention_layernorm.weight", "bfloat16", (h,)),
            Spec(p + "mlp.gate_proj.weight", "bfloat16", (inter, h)),
            Spec(p + "mlp.up_proj.weight", "bfloat16", (inter, h)),
            Spec(p + "mlp.down_proj.weight", "bfloat16", (h, inter)),
        ]
    specs.append(Spec("model.norm.weight", "bfloat16", (h,)))
    return specs


def _timed(fn, device: torch.device, group=None) -> float:
    if group is not None:
        group.broadcast(torch.ones(1, device=device))  # line both ranks up
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _gpu_rank(rank: int, port: int, bucket_sizes: list[int], iters: int, out) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    group = build_weight_group("127.0.0.1", port, rank, 2, "nccl", 120)
    specs = qwen3_1_7b_specs()
    tensors = []
    if rank == 0:
        g = torch.Generator(device=device).manual_seed(0)
        tensors = [torch.randn(s.shape, generator=g, device=device, dtype=torch.bfloat16) for s in specs]
    results = {}
    for bucket_bytes in bucket_sizes:
        layout = plan_buckets(specs, bucket_bytes)
        times = []
        received = None
        for _ in range(2 + iters):  # 2 warm-up rounds (NCCL channel setup, allocator)
            if rank == 0:
                times.append(_timed(lambda layout=layout: send_buckets(group, layout, tensors), device, group))
            else:
                box = {}
                times.append(
                    _timed(lambda box=box, layout=layout: box.update(receive_buckets(group, layout)), device, group)
                )
                received = box
        results[bucket_bytes] = {"median_s": statistics.median(times[2:]), "num_buckets": len(layout.bucket_sizes)}
        if rank == 1 and received is not None:
            # Check the bytes that arrived: a checksum per tensor against the sender's.
            sums = torch.stack([received[s.name].float().sum() for s in specs])
        else:
            sums = (
                torch.stack([t.float().sum() for t in tensors]) if rank == 0 else torch.zeros(len(specs), device=device)
            )
        ref = sums.clone()
        group.broadcast(ref)
        results[bucket_bytes]["bytes_match"] = bool(torch.equal(ref, sums))
    # The same bytes as one flat buffer, no packing: NCCL's own ceiling on this link.
    total = sum(s.num_bytes for s in specs)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    raw = [_timed(lambda: group.broadcast(flat), device, group) for _ in range(2 + iters)][2:]
    out.put((rank, results, statistics.median(raw)))
    group.close()


def bench_gpu(iters: int = 5) -> dict:
    import torch.multiprocessing as mp

    specs = qwen3_1_7b_specs()
    total = sum(s.num_bytes for s in specs)
    # GPU-to-GPU copy bandwidth on this link, measured in the same run.
    src = torch.empty(total, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(total, dtype=torch.uint8, device="cuda:1")
    dst.copy_(src)
    copy_times = []
    for _ in range(iters):
        torch.cuda.synchronize(0), torch.cuda.synchronize(1)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(0), torch.cuda.synchronize(1)
        copy_times.append(time.perf_counter() - start)
    del src, dst
    torch.cuda.empty_cache()
    copy_s = statistics.median(copy_times)

    bucket_sizes = [64 << 20, 256 << 20, 1 << 30]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gpu_rank, args=(r, port, bucket_sizes, iters, out)) for r in range(2)]
    for p in procs:
        p.start()
    by_rank = dict((r, (res, raw)) for r, res, raw in (out.get(timeout=240) for _ in procs))
    for p in procs:
        p.join()
    copy_gbs = total / copy_s / 1e9
    runs = {}
    for b in bucket_sizes:
        seconds = max(by_rank[0][0][b]["median_s"], by_rank[1][0][b]["median_s"])
        runs[f"{b >> 20}MiB"] = {
            "seconds": seconds,
            "GB_per_s": total / seconds / 1e9,
            "fraction_of_copy": (total / seconds / 1e9) / copy_gbs,
            "num_buckets": by_rank[0][0][b]["num_buckets"],
            "bytes_match": by_rank[1][0][b]["bytes_match"],
        }
    raw_s = max(by_rank[0][1], by_rank[1][1])
    best = min(runs, key=lambda k: runs[k]["seconds"])
    return {
        "mode": "gpu",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "state_dict": {"tensors": len(specs), "bytes": total, "dtype": "bfloat16", "shape_of": "Qwen3-1.7B"},
        "gpu_to_gpu_copy": {"seconds": copy_s, "GB_per_s": copy_gbs},
        "nccl_flat_broadcast": {"seconds": raw_s, "GB_per_s": total / raw_s / 1e9},
        "nccl_bucketed_broadcast": runs,
        "best": {"bucket": best, **runs[best]},
        "goal_met": runs[best]["fraction_of_copy"] >= 0.8,
    }


# -- cpu ------------------------------------------------------------------------------------------


def bench_cpu(iters: int = 5) -> dict:
    import tempfile

    from safetensors.torch import load_file, save_file

    from prime_rl.common.testing import make_tiny_model
    from prime_rl.common.transport import ControlClient
    from prime_rl.common.wire import LoadWeightsRequest
    from prime_rl.inference.testing import start_server, stop_server
    from prime_rl.trainer.weights.broadcast_sender import WeightBroadcaster

    tmp = Path(tempfile.mkdtemp(prefix="wt-bench-"))
    model = make_tiny_model(tmp / "tiny", dtype="float32", tie_word_embeddings=True)
    server = start_server(tmp, model)  # returns once control plane and HTTP answer
    endpoint = server.control
    try:
        sd = load_file(model / "model.safetensors")
        total = sum(t.numel() * t.element_size() for t in sd.values())
        write_s, load_s = [], []
        with ControlClient(endpoint, timeout_s=120) as c:
            for step in range(1, iters + 1):
                out = tmp / "broadcasts" / f"step_{step}"
                out.mkdir(parents=True)
                start = time.perf_counter()
                save_file(sd, out / "model.safetensors")
                (out / "STABLE").touch()
                write_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                reply = c.request(LoadWeightsRequest(path=str(out), version=step))
                load_s.append(time.perf_counter() - start)
                assert reply.ok, reply.error
        b = WeightBroadcaster([endpoint], host="127.0.0.1", port=free_port(), backend="gloo", timeout_s=120)
        b.connect()
        push_s = []
        for step in range(iters):
            start = time.perf_counter()
            b.push(100 + step, sd.items())
            push_s.append(time.perf_counter() - start)
        b.close()
    finally:
        stop_server(server.proc)
    fs = statistics.median(write_s) + statistics.median(load_s)
    return {
        "mode": "cpu",
        "model": {"tensors": len(sd), "bytes": total, "dtype": "float32"},
        "filesystem": {
            "write_s": statistics.median(write_s),
            "load_s": statistics.median(load_s),
            "total_s": fs,
        },
        "gloo_broadcast": {"push_s": statistics.median(push_s)},
        "note": "update = pause + transfer + layerwise reload + prefix-cache reset + resume, median of "
        f"{iters}; load_s / push_s are client-side round trips",
    }


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ("gpu" if torch.cuda.device_count() >= 2 else "cpu")
    result = bench_gpu() if mode == "gpu" else bench_cpu()
    print(json.dumps(result, indent=2))
