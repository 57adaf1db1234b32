"""Checks for the blockwise-FP8 Triton grouped GEMM (`grouped_gemm/fp8_op.py`).

1. The quantization kernels reproduce the torch reference quantizer bit for bit.
2. Forward, input gradient and weight gradient equal a float64 evaluation of the same quantized math (the
   reference quantizer's payloads and scales, multiplied in float64): only fp32 accumulation differs.
3. Against unquantized float64 math, the fp8 SwiGLU's error is measured beside the bf16 path's and held
   to ACCURACY_BOUND (see there for why not 2x bf16).

Imported by the GPU test, and run as a script under TRITON_INTERPRET=1 (`python grouped_gemm_fp8_cases.py`)
to exercise the kernels on CPU in a fresh process.
"""

import json
import os
import sys

import torch

from prime_rl.kernels.grouped_gemm.fp8_reference import BLOCK, quantize_1x128, quantize_128x128

SAME_MATH_TOL = 2e-5
"""Max abs error / max abs reference for the kernel against float64 of its own quantized operands: the
kernel accumulates in fp32 (K up to a few thousand: ~1e-6) and rounds to the output dtype (fp32 here)."""
ACCURACY_BOUND = {"out": 0.08, "dx": 0.08, "dw": 0.08}
"""Relative error in norm, ||fp8 - fp64|| / ||fp64||, of the SwiGLU's output, input gradient and weight
gradients. Measured on CPU (interpreter, [200, 0, 70, 150] x 256 x 128): fp8 0.064 / 0.066 / 0.065, bf16
0.0055 / 0.0057 / 0.0055, so fp8 is ~12x bf16. e4m3 keeps 3 mantissa bits where bf16 keeps 7 (16x the
rounding step), and that error comes from quantizing the operands, not from the kernel: item 2 holds the
kernel to the torch reference recipe within 1e-7. The issue's "within 2x of bf16's error" cannot hold at
the GEMM level for any e4m3 GEMM; whether the loss tracks bf16 is a separate (GPU, tiny-MoE) check."""
SAME_MATH_OUT_TOL = {torch.float32: SAME_MATH_TOL, torch.bfloat16: 2**-8}
"""bf16 outputs add their own rounding (relative 2^-9 per element) to the fp32 accumulation's."""


def make_inputs(counts: list[int], k: int, n: int, device: str, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    m, e = sum(counts), len(counts)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(e, n, k, generator=g) / k**0.5
    dy = torch.randn(m, n, generator=g)
    ends = torch.tensor(counts).cumsum(0).to(device=device, dtype=torch.int32)
    return [t.to(device=device, dtype=dtype) for t in (x, w, dy)], ends


def _dq(q: torch.Tensor, scale: torch.Tensor, cols: int) -> torch.Tensor:
    """1x128 payload (R, Cp) and scales -> float64 (R, cols), exact (fp32 would round q * s)."""
    return (q.double().unflatten(-1, (-1, BLOCK)) * scale.double().unsqueeze(-1)).flatten(-2)[:, :cols]


def _dq_w(q: torch.Tensor, scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    full = scale.double().repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)
    return (q.double() * full)[:, :n, :k]


def quantized_reference(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, counts: list[int]):
    """float64 y, dx, dw of y = x @ w[e]^T with the recipe's quantization (the torch reference quantizer)."""
    (m, k), n = x.shape, w.shape[1]  # on x's device: float64 GEMMs at the shape need the GPU
    xd, dyd = _dq(*quantize_1x128(x), k), _dq(*quantize_1x128(dy), n)
    wd = _dq_w(*quantize_128x128(w), n, k)
    y, dx, dw = x.new_zeros(m, n, dtype=torch.float64), x.new_zeros(m, k, dtype=torch.float64), []
    start = 0
    for i, c in enumerate(counts):
        r = slice(start, start + c)
        y[r], dx[r] = xd[r] @ wd[i].t(), dyd[r] @ wd[i]
        # the weight gradient: 128 tokens per column, blocks starting at the expert's first row
        dyt = _dq(*quantize_1x128(dy[r].t()), c) if c else dy.new_zeros(n, 0, dtype=torch.float64)
        xt = _dq(*quantize_1x128(x[r].t()), c) if c else x.new_zeros(k, 0, dtype=torch.float64)
        dw.append(dyt @ xt.t())
        start += c
    return y, dx, torch.stack(dw)


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if b.numel() == 0:
        return 0.0
    return ((a.detach().to(b.device, torch.float64) - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def check_quantizers(device: str) -> None:
    from prime_rl.kernels.grouped_gemm.fp8_op import fp8_tile_map, quantize_rows, quantize_weight

    counts = [130, 0, 37, 1]
    (x, w, _), ends = make_inputs(counts, 200, 136, device, torch.bfloat16)
    x[3, :128] = 0.0  # a zero block: the floor gives a finite scale and zeros
    q, s, qt, st = quantize_rows(x, ends, *fp8_tile_map(ends, x.shape[0]), rowwise=True, colwise=True)
    rq, rs = quantize_1x128(x.cpu())
    assert torch.equal(q.cpu().view(torch.uint8), rq[:, :200].view(torch.uint8)), "1x128 payload"
    assert torch.equal(s.cpu(), rs), "1x128 scales"
    tile = 0
    for start, c in zip(torch.tensor([0, *counts]).cumsum(0).tolist(), counts, strict=False):
        if c:  # this expert's token blocks are tiles [tile, tile + cdiv(c, 128)) of the map
            tq, ts = quantize_1x128(x[start : start + c].cpu().t())
            nb = ts.shape[1]
            assert torch.equal(qt[:, start : start + c].cpu().view(torch.uint8), tq[:, :c].view(torch.uint8))
            assert torch.equal(st[tile : tile + nb].cpu(), ts.t()), f"token-block scales of rows {start}+{c}"
            tile += nb
    for transposed in (False, True):
        wq, ws = quantize_weight(w, transposed)
        rwq, rws = quantize_128x128(w.cpu())
        assert torch.equal(wq.cpu().view(torch.uint8), rwq[:, :136, :200].view(torch.uint8)), "128x128 payload"
        assert torch.equal(ws.cpu(), rws), "128x128 scales"


def check_same_math(counts: list[int], k: int, n: int, device: str, dtype: torch.dtype = torch.float32) -> dict:
    """The op's forward and both gradients against float64 of the same quantized operands."""
    from prime_rl.kernels.grouped_gemm.fp8_op import fp8_grouped_mm, fp8_tile_map

    (x, w, dy), ends = make_inputs(counts, k, n, device, dtype)
    x.requires_grad_(), w.requires_grad_()
    y = fp8_grouped_mm(x, w, ends, *fp8_tile_map(ends, x.shape[0]))
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    want = quantized_reference(x.detach(), w.detach(), dy, counts)
    errs = {name: _max_rel(a, b) for name, a, b in zip(("y", "dx", "dw"), (y, dx, dw), want, strict=True)}
    ctx = f"counts={counts} K={k} N={n}"
    assert all(v <= SAME_MATH_OUT_TOL[dtype] for v in errs.values()), f"{errs}; {ctx} dtype={dtype}"
    for e, c in enumerate(counts):
        assert c or dw[e].abs().max().item() == 0.0, f"expert {e} without rows has a nonzero gradient; {ctx}"
    return errs


def accuracy_vs_unquantized(counts: list[int], hidden: int, inter: int, device: str) -> dict:
    """Relative errors in norm of the fp8 and the bf16 SwiGLU (output, dx, and all weight gradients
    together) against float64 without quantization; asserts ACCURACY_BOUND for fp8."""
    from prime_rl.kernels.grouped_gemm import grouped_swiglu_loop
    from prime_rl.kernels.grouped_gemm.fp8_op import fp8_grouped_swiglu_triton

    g = torch.Generator().manual_seed(1)
    e, m = len(counts), sum(counts)
    x = torch.randn(m, hidden, generator=g)
    ws = [torch.randn(e, inter, hidden, generator=g) / hidden**0.5 for _ in range(2)]
    ws.append(torch.randn(e, hidden, inter, generator=g) / inter**0.5)
    dy = torch.randn(m, hidden, generator=g)
    counts_t = torch.tensor(counts)

    def run(fn, dtype: torch.dtype, dev: str) -> list[torch.Tensor]:  # noqa: ANN001
        leaves = [t.to(dev, dtype).requires_grad_() for t in (x, *ws)]
        y = fn(leaves[0], counts_t.to(dev), *leaves[1:])
        grads = torch.autograd.grad(y, leaves, dy.to(dev, dtype), allow_unused=True)
        dw = torch.cat([g_.flatten() for g_ in grads[1:]])
        return [t.detach().cpu().double() for t in (y, grads[0], dw)]

    ref = run(grouped_swiglu_loop, torch.float64, "cpu")
    fp8 = run(fp8_grouped_swiglu_triton, torch.bfloat16, device)
    # bf16's error is a property of bf16 operands and outputs, so the per-expert loop measures it (the
    # Triton bf16 kernel is held to float64 by grouped_gemm_cases.py). Not that kernel in the interpreter:
    # slow there (185 s), and the interpreter casts fp32 -> bf16 by truncation (triton 3.9: twice RNE's error)
    bf16 = run(grouped_swiglu_loop, torch.bfloat16, device)
    out = {"counts": counts, "hidden": hidden, "inter": inter}
    for name, r, a, b in zip(("out", "dx", "dw"), ref, fp8, bf16, strict=True):
        out[f"fp8_{name}"] = ((a - r).norm() / r.norm()).item()
        out[f"bf16_{name}"] = ((b - r).norm() / r.norm()).item()
        out[f"fp8_over_bf16_{name}"] = out[f"fp8_{name}"] / max(out[f"bf16_{name}"], 1e-12)
        out[f"fp8_{name}_max_rel"] = _max_rel(a, r)
        out[f"bf16_{name}_max_rel"] = _max_rel(b, r)
    bad = {k: out[f"fp8_{k}"] for k in ACCURACY_BOUND if out[f"fp8_{k}"] > ACCURACY_BOUND[k]}
    assert not bad, f"fp8 relative error in norm {bad} above {ACCURACY_BOUND}; {out}"
    return out


CASES = [
    ([130, 0, 37, 1], 200, 136),  # a full tile + a partial one, an empty expert, one row; K, N partial blocks
    ([0, 5, 0], 128, 64),  # empty first and last experts, one K block
    ([0, 0], 64, 32),  # nothing routed here
]


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    check_quantizers("cpu")
    print("ok quantizers")
    for counts, k, n in CASES:
        print(f"ok same math counts={counts} {json.dumps(check_same_math(counts, k, n, 'cpu'))}", flush=True)
    print(f"ok accuracy {json.dumps(accuracy_vs_unquantized([200, 0, 70, 150], 256, 128, 'cpu'))}", flush=True)

    from prime_rl.kernels.grouped_gemm.fp8_op import fp8_grouped_mm, fp8_tile_map

    (x, w, _), ends = make_inputs([7, 0, 40], 128, 32, "cpu", torch.float32)
    args = (x.requires_grad_(), w.requires_grad_(), ends, *fp8_tile_map(ends, x.shape[0]))
    torch.library.opcheck(fp8_grouped_mm, args)
    compiled = torch.compile(fp8_grouped_mm, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*args), fp8_grouped_mm(*args))
    # the gate / up pair (x quantized once) is exactly two single ops, forward and backward
    from prime_rl.kernels.grouped_gemm.fp8_op import fp8_grouped_mm_pair

    w2 = (w.detach().flip(0) * 3).requires_grad_()
    y1, y2 = fp8_grouped_mm_pair(x, w, w2, *args[2:])
    assert torch.equal(y1, fp8_grouped_mm(*args)) and torch.equal(y2, fp8_grouped_mm(x, w2, *args[2:]))
    g1, g2 = torch.randn_like(y1), torch.randn_like(y2)
    got = torch.autograd.grad((y1 * g1).sum() + (y2 * g2).sum(), [x, w, w2])
    singles = (fp8_grouped_mm(*args) * g1).sum() + (fp8_grouped_mm(x, w2, *args[2:]) * g2).sum()
    for a, b in zip(got, torch.autograd.grad(singles, [x, w, w2]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.library.opcheck(fp8_grouped_mm_pair, (x, w, w2, *args[2:]))
    print("ok pair = two single ops")

    # the whole SwiGLU (tile map, three ops, their backward) as one graph, as the MoE block compiles it
    from prime_rl.kernels.grouped_gemm.fp8_op import fp8_grouped_swiglu_triton

    counts = torch.tensor([7, 0, 40])
    ws = [w.detach().requires_grad_(), w.detach().requires_grad_(), w.detach().transpose(1, 2).requires_grad_()]
    swiglu = torch.compile(fp8_grouped_swiglu_triton, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(swiglu(x, counts, *ws).sum(), [x, *ws])
    want = torch.autograd.grad(fp8_grouped_swiglu_triton(x, counts, *ws).sum(), [x, *ws])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    print("ok opcheck + fullgraph compile")
    sys.exit(0)
