"""Benchmark: routed-expert SwiGLU (forward + backward) as the Triton grouped GEMM vs torch._grouped_mm
(CUTLASS, where this torch has it) vs a per-expert loop of cuBLAS matmuls. Prints one JSON object per line.

    python benchmarks/grouped_gemm.py [--tokens 16384] [--experts 128] [--top-k 8] [--hidden 2048] [--inter 768]

Routing is random top-k (a balanced load, as a trained router with load balancing gives). Times are
medians of CUDA-event timed steps after warm-up (autotuning happens in the warm-up). TFLOP/s counts
the 3 GEMMs forward and 6 backward: 18 * M * H * I flops for M routed rows.
"""

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from prime_rl.kernels.grouped_gemm import grouped_swiglu_loop, grouped_swiglu_triton


def swiglu_torch_grouped_mm(x, counts, w_gate, w_up, w_down):  # noqa: ANN001, ANN201
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    gate = torch._grouped_mm(x, w_gate.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(x, w_up.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(F.silu(gate) * up, w_down.transpose(-2, -1), offs=offs)


def time_ms(fn, args: list[torch.Tensor], grad: torch.Tensor | None, warmup: int = 5, steps: int = 20) -> float:
    """Median ms of fn(*args) plus, with grad, its backward."""
    times = []
    for i in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.set_grad_enabled(grad is not None):
            out = fn(*args)
        if grad is not None:
            torch.autograd.grad(out, [args[0], *args[2:]], grad)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    a = p.parse_args()
    torch.manual_seed(0)
    E, H, inter = a.experts, a.hidden, a.inter
    topk = torch.rand(a.tokens, E, device="cuda").topk(a.top_k, dim=-1).indices.reshape(-1)
    counts = torch.bincount(topk, minlength=E)
    M = int(counts.sum())
    x = (torch.randn(M, H, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    ws = [(torch.randn(E, inter, H, device="cuda") / H**0.5).to(torch.bfloat16).requires_grad_() for _ in range(2)]
    ws.append((torch.randn(E, H, inter, device="cuda") / inter**0.5).to(torch.bfloat16).requires_grad_())
    grad = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    args = [x, counts, *ws]
    ref = grouped_swiglu_loop(x.float(), counts, *(w.float() for w in ws))
    flops = 18 * M * H * inter
    impls = {"triton": grouped_swiglu_triton, "loop_cublas": grouped_swiglu_loop}
    if hasattr(torch, "_grouped_mm"):
        impls["torch_grouped_mm"] = swiglu_torch_grouped_mm
    results = {}
    for name, fn in impls.items():
        err = ((fn(*args).float() - ref).abs().max() / ref.abs().max()).item()
        ms, fwd_ms = time_ms(fn, args, grad), time_ms(fn, args, None)
        results[name] = ms
        print(json.dumps(dict(impl=name, tokens=a.tokens, rows=M, experts=E, top_k=a.top_k, hidden=H, inter=inter,
                              fwd_bwd_ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1), fwd_ms=round(fwd_ms, 3),
                              fwd_tflops=round(flops / 3 / fwd_ms / 1e9, 1),
                              max_rel_err_vs_fp32=round(err, 5))), flush=True)  # fmt: skip
    print(json.dumps({f"triton_speedup_vs_{k}": round(v / results["triton"], 2) for k, v in results.items()}))


if __name__ == "__main__":
    main()
