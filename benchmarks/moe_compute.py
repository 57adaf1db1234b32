"""Benchmark: routed-expert SwiGLU (forward + backward) with `[model.moe.compute] type = "bf16"` (the Triton
grouped GEMM) vs `type = "fp8"`: the Triton grouped blockwise-FP8 kernels (`fp8_triton`, what fp8 runs on
SM90 with triton) and torch's SM90 scaled_mm per expert (`fp8_scaled_mm`, the fallback), quantization
included. Prints one JSON object per line, then one with each fp8 path's time over bf16's.

    python benchmarks/moe_compute.py                      # Qwen3-30B-A3B layer: 128 experts, 2048 x 768, top-8
    python benchmarks/moe_compute.py --experts 16 --tokens 2048   # one EP=8 rank: 16 local experts
    python benchmarks/moe_compute.py --compute bf16 fp8_triton    # skip the slow fallback
    python benchmarks/moe_compute.py --device cpu --tokens 256 --experts 8 --hidden 256 --inter 128   # smoke

Routing is random top-k (a balanced load). GPU times are medians of CUDA-event timed steps after warm-up
(the warm-up also runs Triton's autotuning); CPU times (smoke only: fp8 there is the dequantizing
reference, fp8_triton is skipped) use perf_counter. TFLOP/s counts the 3 GEMMs forward and 6 backward:
18 * M * H * I flops for M routed rows, whatever the precision. `max_rel_err_vs_fp32` is the output's
largest error against unquantized fp32 math, relative to its largest value. Also reported: each fp8 path's
quantization alone (activations 1x128 + the three weights 128x128), the part of its time that is no GEMM.
"""

import argparse
import json
import statistics
import time

import torch

from prime_rl.kernels.grouped_gemm import grouped_swiglu, grouped_swiglu_loop
from prime_rl.trainer.models.moe_compute import (
    fp8_grouped_swiglu_torch,
    fp8_grouped_swiglu_triton,
    quantize_1x128,
    quantize_128x128,
    sm90_scaled_mm_enabled,
)

COMPUTE = {"bf16": grouped_swiglu, "fp8_triton": fp8_grouped_swiglu_triton, "fp8_scaled_mm": fp8_grouped_swiglu_torch}


def time_ms(fn, device: torch.device, warmup: int, steps: int) -> float:  # noqa: ANN001
    """Median ms of fn()."""
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            elapsed = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(elapsed)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="tokens before top-k (rows = tokens * top_k)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--compute", nargs="+", default=list(COMPUTE), choices=list(COMPUTE))
    a = p.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not sm90_scaled_mm_enabled(device):
        cap = torch.cuda.get_device_capability(device)
        print(json.dumps({"error": f"fp8 expert GEMMs need an SM90 GPU and torch >= 2.10, got SM{cap[0]}{cap[1]}"}))
        return
    torch.manual_seed(0)
    E, H, inter = a.experts, a.hidden, a.inter
    topk = torch.rand(a.tokens, E, device=device).topk(a.top_k, dim=-1).indices.reshape(-1)
    counts = torch.bincount(topk, minlength=E)
    M = int(counts.sum())
    dtype = torch.bfloat16
    x = (torch.randn(M, H, device=device) * 0.5).to(dtype).requires_grad_()
    ws = [(torch.randn(E, inter, H, device=device) / H**0.5).to(dtype).requires_grad_() for _ in range(2)]
    ws.append((torch.randn(E, H, inter, device=device) / inter**0.5).to(dtype).requires_grad_())
    grad = torch.randn(M, H, device=device, dtype=dtype)
    ref = grouped_swiglu_loop(x.detach().float(), counts, *(w.detach().float() for w in ws))
    flops = 18 * M * H * inter
    shape = dict(device=str(device), tokens=a.tokens, rows=M, experts=E, top_k=a.top_k, hidden=H, inter=inter)

    results = {}
    for name in a.compute:
        fn = COMPUTE[name]
        if name == "fp8_triton" and (device.type != "cuda" or fn is None):
            print(json.dumps({"compute": name, "skipped": "needs CUDA and triton"}), flush=True)
            continue
        with torch.no_grad():
            err = ((fn(x, counts, *ws).float() - ref).abs().max() / ref.abs().max()).item()

        def fwd_bwd(fn=fn) -> None:  # noqa: ANN001
            torch.autograd.grad(fn(x, counts, *ws), [x, *ws], grad)

        def fwd(fn=fn) -> None:  # noqa: ANN001
            with torch.no_grad():
                fn(x, counts, *ws)

        ms, fwd_ms = time_ms(fwd_bwd, device, a.warmup, a.steps), time_ms(fwd, device, a.warmup, a.steps)
        results[name] = ms
        print(json.dumps(dict(compute=name, **shape, fwd_bwd_ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1),
                              fwd_ms=round(fwd_ms, 3), fwd_tflops=round(flops / 3 / fwd_ms / 1e9, 1),
                              max_rel_err_vs_fp32=round(err, 5))), flush=True)  # fmt: skip

    def quantize_all() -> None:
        with torch.no_grad():
            quantize_1x128(x)
            for w in ws:
                quantize_128x128(w)

    if "fp8_scaled_mm" in results:
        quant_ms = time_ms(quantize_all, device, a.warmup, a.steps)
        print(json.dumps(dict(compute="fp8_torch_quantize_only", **shape, ms=round(quant_ms, 3))), flush=True)
    if "fp8_triton" in results:  # the Triton path's forward quantization: x once, the three weights
        from prime_rl.kernels.grouped_gemm.fp8_op import fp8_tile_map, quantize_rows, quantize_weight

        ends = torch.cumsum(counts, 0, dtype=torch.int32)
        tiles = fp8_tile_map(ends, M)

        def quantize_triton() -> None:
            with torch.no_grad():
                quantize_rows(x, ends, *tiles, rowwise=True, colwise=False)
                for w in ws:
                    quantize_weight(w, transposed=False)

        quant_ms = time_ms(quantize_triton, device, a.warmup, a.steps)
        print(json.dumps(dict(compute="fp8_triton_quantize_only", **shape, ms=round(quant_ms, 3))), flush=True)
    if "bf16" in results:
        ratios = {
            f"{k}_over_bf16_fwd_bwd_time": round(v / results["bf16"], 3) for k, v in results.items() if k != "bf16"
        }
        print(json.dumps(dict(**shape, **ratios)))


if __name__ == "__main__":
    main()
