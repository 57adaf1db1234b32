"""Triton grouped GEMMs for routed experts (imported only when triton is importable).

Rows of `a` are grouped by expert: group e is rows [ends[e-1], ends[e]) (ends = cumsum of the
per-expert counts, on the device, so launching never syncs with the host).

`grouped_mm_kernel` (forward and input gradient): out[rows of e] = a[rows of e] @ b[e], b (E, K, N)
with any strides (a transposed weight view costs nothing). One program per (row tile, column tile).
Row tiles of MM_BLOCK_M rows are numbered expert by expert; `tile_map` (torch, on the device, once per
MoE layer) gives each its expert and first row. The grid is sized for the worst case,
cdiv(M, MM_BLOCK_M) + E row tiles (each group adds at most one partial tile); programs past the last
tile return at once. MM_BLOCK_M is fixed (the map depends on it); the rest is autotuned.

`grouped_mm_wgrad_kernel` (weight gradient): out[e] = a[rows of e]^T @ b[rows of e], (E, K, N). One
program per (K tile, N tile, expert) walks its group's rows; programs of one expert are launched
together so they share its rows in L2. An expert that got no token gets an exact zero gradient, so
every rank produces the same set of gradients whatever the routing.

Set TRITON_INTERPRET=1 before importing to run these kernels on CPU (tests do, on small shapes).
"""

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
INTERPRET_DOT_UPCAST = tl.constexpr(INTERPRET)

if INTERPRET:
    # The interpreter runs each program in numpy: small tiles keep tests fast, one config skips autotuning.
    MM_BLOCK_M = 16
    _MM_CONFIGS = [triton.Config({"BLOCK_N": 16, "BLOCK_K": 16})]
    _WGRAD_CONFIGS = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16})]
else:
    MM_BLOCK_M = 128  # rows per tile of grouped_mm_kernel (Hopper MMA-friendly; the tile map is built for it)
    _MM_CONFIGS = [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bn, bk, w, st in [(128, 64, 8, 3), (256, 64, 8, 3), (128, 64, 4, 4), (128, 128, 8, 3), (64, 64, 4, 4)]
    ]
    _WGRAD_CONFIGS = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bm, bn, bk, w, st in [
            (64, 128, 128, 8, 3),
            (32, 128, 128, 4, 4),
            (64, 128, 64, 4, 4),
            (64, 256, 128, 8, 3),
        ]
    ]


@triton.jit
def _dot(a, b, acc):
    if INTERPRET_DOT_UPCAST:
        # The interpreter's bf16 x bf16 -> fp32 dot is wrong (triton 3.9); bf16 products are exact in fp32.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.autotune(configs=_MM_CONFIGS, key=["N", "K", "E"])
@triton.jit
def grouped_mm_kernel(
    a_ptr,  # (M, K)
    b_ptr,  # (E, K, N)
    out_ptr,  # (M, N)
    ends_ptr,  # (E,) int: end row of each group
    tile_expert_ptr,  # (T,) int32: expert of each row tile, E for padding tiles
    tile_row_ptr,  # (T,) int32: first row of each row tile
    N,
    K,
    E,
    stride_am,
    stride_ak,
    stride_be,
    stride_bk,
    stride_bn,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= E:
        return  # padding program: the worst-case grid has more row tiles than this routing
    row_start = tl.load(tile_row_ptr + tile)
    row_end = tl.load(ends_ptr + expert).to(tl.int32)

    rows = row_start + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < row_end
    col_mask = cols < N
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = _dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.autotune(configs=_WGRAD_CONFIGS, key=["N", "K", "E"])
@triton.jit
def grouped_mm_wgrad_kernel(
    a_ptr,  # (M, K)
    b_ptr,  # (M, N)
    out_ptr,  # (E, K, N)
    ends_ptr,  # (E,) int: end row of each group
    N,
    K,
    E,
    stride_am,
    stride_ak,
    stride_bm,
    stride_bn,
    stride_oe,
    stride_ok,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert = tl.program_id(1)
    k_tiles = tl.cdiv(K, BLOCK_K)
    pid_k = tl.program_id(0) % k_tiles
    pid_n = tl.program_id(0) // k_tiles
    row_end = tl.load(ends_ptr + expert).to(tl.int32)
    row_start = 0
    if expert > 0:
        row_start = tl.load(ends_ptr + expert - 1).to(tl.int32)

    kk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ms = tl.arange(0, BLOCK_M)
    k_mask = kk < K
    col_mask = cols < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(row_start, row_end, BLOCK_M):
        rows = m0 + ms
        row_mask = rows < row_end
        a = tl.load(  # (BLOCK_M, BLOCK_K), read along a's rows (contiguous K), then transposed in registers
            a_ptr + rows[:, None].to(tl.int64) * stride_am + kk[None, :] * stride_ak,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + rows[:, None].to(tl.int64) * stride_bm + cols[None, :] * stride_bn,
            mask=row_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        acc = _dot(tl.trans(a), b, acc)
    out_ptrs = out_ptr + expert.to(tl.int64) * stride_oe + kk[:, None] * stride_ok + cols[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=k_mask[:, None] & col_mask[None, :])
