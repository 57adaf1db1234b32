"""`fp8_grouped_mm(x, w, ends, tile_expert, tile_row)`: blockwise-FP8 grouped linear as a torch custom op
with autograd, over the Triton kernels of `fp8_triton_kernels.py`.

    x (M, K) rows grouped by expert, w (E, N, K) (nn.Linear layout), ends (E,) int32 cumulative row counts
    tile_expert, tile_row = tile_map(ends, M, QBLOCK): 128-row tiles, each within one expert -> (M, N)
    forward:  y = q(x) @ q(w[e])^T        x 1x128 along K, w 128x128 (3 launches: quantize x, w, GEMM)
    backward: dx = q(dy) @ q(w[e])        dy 1x128 along N, w's 128x128 blocks transposed with it
              dw[e] = q(dy)^T @ q(x)      both 128 tokens per column within the expert (DeepSeek-V3's wgrad)
              (5 launches: dy quantized both ways in one read, w, x, and the two GEMMs)

Saved for backward: x and w, not their fp8 copies, as the bf16 op saves them: under FSDP w is the
all-gathered parameter, which costs nothing extra to save, while an fp8 copy of every expert weight
would be new memory held per layer until backward; re-quantizing w is one memory-bound pass.

The weight gradient runs in fp8 too, for two reasons: it is the recipe the torch reference path (and
DeepSeek-V3) computes, so both paths agree to rounding; and its error against unquantized math is of the
same order as the forward's and input gradient's, not worse, because each 128-token block has its own
per-column scale (measured by packages/kernels/tests/grouped_gemm_fp8_cases.py; numbers in docs/moe.md).

`fp8_grouped_mm_pair(x, w1, w2, ...)` is the gate and up projections in one op: x is quantized once
for both forward GEMMs and once for both weight gradients, and the two input gradients are summed.

Left out (next steps once a GPU has measured this): fusing SwiGLU into the down projection's
quantization, reusing the forward's weight quantization in backward, and a persistent / TMA kernel.
"""

import torch
import torch.nn.functional as F
import triton

from prime_rl.kernels.grouped_gemm.fp8_triton_kernels import (
    QBLOCK,
    fp8_grouped_mm_kernel,
    fp8_grouped_wgrad_kernel,
    quantize_rows_kernel,
    quantize_weight_kernel,
)
from prime_rl.kernels.grouped_gemm.op import tile_map

FP8 = torch.float8_e4m3fn


def fp8_tile_map(ends: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 128-row tile map every fp8 kernel shares (its tiles are also the wgrad's token blocks)."""
    return tile_map(ends, num_rows, QBLOCK)


def quantize_rows(
    x: torch.Tensor, ends: torch.Tensor, tile_expert: torch.Tensor, tile_row: torch.Tensor, rowwise: bool, colwise: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """x (M, C) -> rowwise: q (M, C) e4m3, s (M, cdiv(C, 128)); colwise: qt (C, M) e4m3 (x^T's payload),
    st (T, C) (one scale per row tile and column). One launch, one read of x."""
    (M, C), T, E = x.shape, tile_expert.shape[0], ends.shape[0]
    q = s = qt = st = None
    if rowwise:
        q, s = x.new_empty(M, C, dtype=FP8), x.new_empty(M, triton.cdiv(C, QBLOCK), dtype=torch.float32)
    if colwise:
        qt, st = x.new_empty(C, M, dtype=FP8), x.new_empty(T, C, dtype=torch.float32)  # pad tiles unread
    if M == 0:
        return q, s, qt, st
    unused = (x, (0, 0))  # a pointer and strides the kernel never touches (constexpr-disabled branch)
    q_args = (q, q.stride()) if rowwise else unused
    s_args = (s, s.stride()) if rowwise else unused
    qt_args = (qt, qt.stride()) if colwise else unused
    st_args = (st, st.stride()) if colwise else unused
    quantize_rows_kernel[(T, triton.cdiv(C, QBLOCK))](
        x, q_args[0], s_args[0], qt_args[0], st_args[0], ends, tile_expert, tile_row, C, E,
        *x.stride(), *q_args[1], *s_args[1], *qt_args[1], *st_args[1],
        ROWWISE=rowwise, COLWISE=colwise, num_warps=8,  # a 128 x 128 fp32 tile per program
    )  # fmt: skip
    return q, s, qt, st


def quantize_weight(w: torch.Tensor, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w (E, N, K) -> q (E, N, K) e4m3, s (E, cdiv(N, 128), cdiv(K, 128)). `transposed`: q's storage is
    (E, K, N) (N contiguous: the input gradient contracts over N), returned as its (E, N, K) view."""
    E, N, K = w.shape
    q = w.new_empty(E, K, N, dtype=FP8).transpose(1, 2) if transposed else w.new_empty(E, N, K, dtype=FP8)
    s = w.new_empty(E, triton.cdiv(N, QBLOCK), triton.cdiv(K, QBLOCK), dtype=torch.float32)
    if w.numel():
        grid = (triton.cdiv(N, QBLOCK) * triton.cdiv(K, QBLOCK), E)
        quantize_weight_kernel[grid](w, q, s, N, K, *w.stride(), *q.stride(), *s.stride(), num_warps=8)
    return q, s


def _gemm(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    b_q: torch.Tensor,
    b_s: torch.Tensor,
    ends: torch.Tensor,
    tile_expert: torch.Tensor,
    tile_row: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """a (M, K) with 1x128 scales, b (E, K, N) with 128x128 scales (E, Kb, Nb), any strides -> (M, N)."""
    (M, K), (E, _, N) = a_q.shape, b_q.shape
    out = a_q.new_empty(M, N, dtype=out_dtype)
    if M == 0:
        return out

    def grid(meta: dict) -> tuple[int, int]:
        return tile_expert.shape[0], triton.cdiv(N, meta["BLOCK_N"])

    fp8_grouped_mm_kernel[grid](
        a_q, a_s, b_q, b_s, out, ends, tile_expert, tile_row, N, K, E,
        *a_q.stride(), *a_s.stride(), *b_q.stride(), *b_s.stride(), *out.stride(),
    )  # fmt: skip
    return out


def _first_tiles(ends: torch.Tensor) -> torch.Tensor:
    """(E,) int32: index of each expert's first 128-row tile in the tile map (device ops, no sync)."""
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tiles = (counts + QBLOCK - 1) // QBLOCK
    return (torch.cumsum(tiles, 0) - tiles).to(torch.int32)


def _wgrad(
    at_q: torch.Tensor,
    at_s: torch.Tensor,
    bt_q: torch.Tensor,
    bt_s: torch.Tensor,
    ends: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """at (N, M), bt (K, M) token-contiguous payloads with (T, N), (T, K) scales -> (E, N, K)."""
    (N, M), K, E = at_q.shape, bt_q.shape[0], ends.shape[0]
    out = at_q.new_empty(E, N, K, dtype=dtype)
    if M == 0:
        return out.zero_()

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(N, meta["BLOCK_N"]) * triton.cdiv(K, meta["BLOCK_K"]), E

    fp8_grouped_wgrad_kernel[grid](
        at_q, at_s, bt_q, bt_s, out, ends, _first_tiles(ends), N, K, E,
        *at_q.stride(), *at_s.stride(), *bt_q.stride(), *bt_s.stride(), *out.stride(),
    )  # fmt: skip
    return out


def _forward_gemm(
    x_q: torch.Tensor, x_s: torch.Tensor, w: torch.Tensor, tiles: tuple, dtype: torch.dtype
) -> torch.Tensor:
    w_q, w_s = quantize_weight(w, transposed=False)  # (E, N, K): K contiguous, the forward's contraction
    return _gemm(x_q, x_s, w_q.transpose(1, 2), w_s.transpose(1, 2), *tiles, dtype)


def _grads(
    dy: torch.Tensor, w: torch.Tensor, xt: tuple | None, tiles: tuple, need_dx: bool, dx_dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dx = q(dy) @ q(w[e]) when need_dx; dw[e] = q(dy)^T @ q(x) when xt (x's 128-token quantization) is given."""
    dy_q, dy_s, dyt_q, dyt_s = quantize_rows(dy, *tiles, rowwise=need_dx, colwise=xt is not None)  # one read
    dx = dw = None
    if need_dx:
        w_q, w_s = quantize_weight(w, transposed=True)  # (E, N, K) view, N contiguous: dx contracts over N
        dx = _gemm(dy_q, dy_s, w_q, w_s, *tiles, dx_dtype)
    if xt is not None:
        dw = _wgrad(dyt_q, dyt_s, *xt, tiles[0], w.dtype)
    return dx, dw


def _x_for_wgrad(x: torch.Tensor, tiles: tuple, need_dw: bool) -> tuple | None:
    return quantize_rows(x, *tiles, rowwise=False, colwise=True)[2:] if need_dw else None


@torch.library.custom_op("prime_rl::fp8_grouped_mm", mutates_args=())
def fp8_grouped_mm(
    x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, tile_expert: torch.Tensor, tile_row: torch.Tensor
) -> torch.Tensor:
    tiles = (ends, tile_expert, tile_row)
    x_q, x_s, _, _ = quantize_rows(x, *tiles, rowwise=True, colwise=False)
    return _forward_gemm(x_q, x_s, w, tiles, x.dtype)


@fp8_grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, tile_expert: torch.Tensor, tile_row: torch.Tensor):
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("prime_rl::fp8_grouped_mm_backward", mutates_args=())
def fp8_grouped_mm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    ends: torch.Tensor,
    tile_expert: torch.Tensor,
    tile_row: torch.Tensor,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx (M, K) or empty (0,) when not needed, dw (E, N, K) or empty)."""
    tiles = (ends, tile_expert, tile_row)
    dx, dw = _grads(dy, w, _x_for_wgrad(x, tiles, need_dw), tiles, need_dx, x.dtype)
    return (x.new_empty(0) if dx is None else dx), (x.new_empty(0) if dw is None else dw)


@fp8_grouped_mm_backward.register_fake
def _(dy, x, w, ends, tile_expert, tile_row, need_dx: bool, need_dw: bool):  # noqa: ANN001
    dx = x.new_empty(x.shape) if need_dx else x.new_empty(0)
    dw = w.new_empty(w.shape) if need_dw else x.new_empty(0)
    return dx, dw


def _setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:  # noqa: ANN001
    ctx.save_for_backward(*inputs)  # x and w themselves, not fp8 copies (module docstring)


def _backward(ctx, dy: torch.Tensor) -> tuple:  # noqa: ANN001
    x, w, ends, tile_expert, tile_row = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = fp8_grouped_mm_backward(dy, x, w, ends, tile_expert, tile_row, need_dx, need_dw)
    return (dx if need_dx else None), (dw if need_dw else None), None, None, None


fp8_grouped_mm.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("prime_rl::fp8_grouped_mm_pair", mutates_args=())
def fp8_grouped_mm_pair(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    ends: torch.Tensor,
    tile_expert: torch.Tensor,
    tile_row: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8_grouped_mm(x, w1, ...), fp8_grouped_mm(x, w2, ...)) with x quantized once, forward (1x128) and
    backward (128 tokens): the gate and up projections read the same input."""
    tiles = (ends, tile_expert, tile_row)
    x_q, x_s, _, _ = quantize_rows(x, *tiles, rowwise=True, colwise=False)
    return _forward_gemm(x_q, x_s, w1, tiles, x.dtype), _forward_gemm(x_q, x_s, w2, tiles, x.dtype)


@fp8_grouped_mm_pair.register_fake
def _(x, w1, w2, ends, tile_expert, tile_row):  # noqa: ANN001
    return x.new_empty(x.shape[0], w1.shape[1]), x.new_empty(x.shape[0], w2.shape[1])


@torch.library.custom_op("prime_rl::fp8_grouped_mm_pair_backward", mutates_args=())
def fp8_grouped_mm_pair_backward(
    dy1: torch.Tensor,
    dy2: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    ends: torch.Tensor,
    tile_expert: torch.Tensor,
    tile_row: torch.Tensor,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx = dx1 + dx2, dw1, dw2), each empty (0,) when not needed."""
    tiles = (ends, tile_expert, tile_row)
    xt = _x_for_wgrad(x, tiles, need_dw)  # once for both weight gradients
    dx1, dw1 = _grads(dy1, w1, xt, tiles, need_dx, x.dtype)
    dx2, dw2 = _grads(dy2, w2, xt, tiles, need_dx, x.dtype)
    empty = x.new_empty(0)
    return (dx1.add_(dx2) if need_dx else empty), (dw1 if need_dw else empty), (dw2 if need_dw else empty)


@fp8_grouped_mm_pair_backward.register_fake
def _(dy1, dy2, x, w1, w2, ends, tile_expert, tile_row, need_dx: bool, need_dw: bool):  # noqa: ANN001
    empty = x.new_empty(0)
    dx = x.new_empty(x.shape) if need_dx else empty
    return dx, (w1.new_empty(w1.shape) if need_dw else empty), (w2.new_empty(w2.shape) if need_dw else empty)


def _pair_backward(ctx, dy1: torch.Tensor | None, dy2: torch.Tensor | None) -> tuple:  # noqa: ANN001
    x, w1, w2, ends, tile_expert, tile_row = ctx.saved_tensors
    need_dx = ctx.needs_input_grad[0]
    need_dw = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    m = x.shape[0]  # an output that fed nothing gets a zero gradient
    dy1 = x.new_zeros(m, w1.shape[1]) if dy1 is None else dy1
    dy2 = x.new_zeros(m, w2.shape[1]) if dy2 is None else dy2
    dx, dw1, dw2 = fp8_grouped_mm_pair_backward(dy1, dy2, x, w1, w2, ends, tile_expert, tile_row, need_dx, need_dw)
    return (
        dx if need_dx else None,
        dw1 if ctx.needs_input_grad[1] else None,
        dw2 if ctx.needs_input_grad[2] else None,
        None,
        None,
        None,
    )


fp8_grouped_mm_pair.register_autograd(_pair_backward, setup_context=_setup_context)


def fp8_grouped_swiglu_triton(
    x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """x (M, H) sorted by expert, counts (E,), w_gate / w_up (E, I, H), w_down (E, H, I) -> (M, H), every
    expert GEMM in blockwise FP8; the SwiGLU between them in x's dtype. No host sync."""
    ends = torch.cumsum(counts, dim=0, dtype=torch.int32)
    tiles = fp8_tile_map(ends, x.shape[0])  # shared by the 3 projections and their backward
    gate, up = fp8_grouped_mm_pair(x, w_gate, w_up, ends, *tiles)  # (M, I) each, x quantized once
    return fp8_grouped_mm(F.silu(gate) * up, w_down, ends, *tiles)  # (M, H)
