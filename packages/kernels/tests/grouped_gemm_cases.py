"""Checks for the Triton grouped GEMM against a float64 per-expert loop.

Imported by the GPU test, and run as a script (`python grouped_gemm_cases.py`) under
TRITON_INTERPRET=1 to exercise the Triton kernels on CPU in a fresh process.
"""

import os
import sys

import torch

from prime_rl.kernels.grouped_gemm import grouped_swiglu_loop, grouped_swiglu_triton

# max abs error / max abs value of the float64 reference, per dtype (bf16 rounds gate/up/hidden too)
REL_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def make_inputs(counts: list[int], hidden: int, inter: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    E, M = len(counts), sum(counts)
    x = torch.randn(M, hidden, generator=g)
    w_gate = torch.randn(E, inter, hidden, generator=g) / hidden**0.5
    w_up = torch.randn(E, inter, hidden, generator=g) / hidden**0.5
    w_down = torch.randn(E, hidden, inter, generator=g) / inter**0.5
    grad = torch.randn(M, hidden, generator=g)
    leaves = [t.to(device=device, dtype=dtype).requires_grad_() for t in (x, w_gate, w_up, w_down)]
    return torch.tensor(counts, device=device), leaves, grad.to(device=device, dtype=dtype)


def check_case(counts: list[int], hidden: int, inter: int, dtype: torch.dtype, device: str) -> None:
    counts_t, leaves, grad = make_inputs(counts, hidden, inter, dtype, device)
    out = grouped_swiglu_triton(counts=counts_t, x=leaves[0], w_gate=leaves[1], w_up=leaves[2], w_down=leaves[3])
    got = torch.autograd.grad(out, leaves, grad)
    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in leaves]
    ref = grouped_swiglu_loop(ref_leaves[0], counts_t.cpu(), *ref_leaves[1:])
    want = torch.autograd.grad(ref, ref_leaves, grad.cpu().double(), allow_unused=True)
    want = [torch.zeros_like(t) if w is None else w for t, w in zip(ref_leaves, want, strict=True)]  # x with 0 rows
    ctx = f"counts={counts} H={hidden} I={inter} dtype={dtype}"
    assert out.dtype == dtype and out.shape == ref.shape, ctx
    for name, a, b in [("out", out, ref), *zip(("dx", "dw_gate", "dw_up", "dw_down"), got, want, strict=True)]:
        scale = max(b.abs().max().item(), 1e-6) if b.numel() else 1.0
        err = (a.detach().cpu().double() - b).abs().max().item() if b.numel() else 0.0
        assert err <= REL_TOL[dtype] * scale, f"{name}: max err {err:.3g} vs scale {scale:.3g}; {ctx}"
    for e, n in enumerate(counts):  # an expert without tokens gets an exact zero gradient
        if n == 0:
            assert all(g[e].abs().max().item() == 0.0 for g in got[1:]), f"expert {e} grad not zero; {ctx}"


CASES = [
    ([17, 0, 33, 5], 40, 24),  # an empty expert in the middle, ragged sizes, K/N not tile multiples
    ([0, 21, 3, 0], 32, 48),  # empty first and last experts
    ([50], 16, 16),  # one expert
    ([0, 0, 0], 16, 8),  # no token routed here at all (EP rank that received nothing)
]


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for dtype in (torch.float32, torch.bfloat16):
        for counts, hidden, inter in CASES:
            check_case(counts, hidden, inter, dtype, "cpu")
            print(f"ok counts={counts} dtype={dtype}")

    # one opaque op per projection keeps fullgraph compile whole; the fake impl gives the shapes
    from prime_rl.kernels.grouped_gemm.op import grouped_mm, tile_map

    counts_t, (x, w_gate, _, _), grad = make_inputs([7, 0, 40, 9], 16, 24, torch.float32, "cpu")
    ends = torch.cumsum(counts_t, 0, dtype=torch.int32)
    expert, row = tile_map(ends, x.shape[0])  # 16-row tiles: [0,7) | [7,23) [23,39) [39,47) | [47,56)
    assert expert.tolist() == [0, 2, 2, 2, 3, 4, 4, 4] and row[:5].tolist() == [0, 7, 23, 39, 47], (expert, row)
    args = (x, w_gate.transpose(-2, -1), ends, expert, row)
    torch.library.opcheck(grouped_mm, args)
    compiled = torch.compile(grouped_mm, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*args), grouped_mm(*args))
    print("ok opcheck + fullgraph compile")
    sys.exit(0)
