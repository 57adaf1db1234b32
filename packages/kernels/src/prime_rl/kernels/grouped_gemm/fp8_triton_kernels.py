"""Triton kernels for blockwise-FP8 grouped expert GEMMs (the recipe: `fp8_reference.py`).

Rows are grouped by expert as in `triton_kernels.py` (`ends` on the device, no host sync) and cut into
row tiles of QBLOCK = 128 rows, numbered expert by expert (`tile_map(ends, M, QBLOCK)`): a row tile never
crosses experts, so it is also the weight gradient's 128-token quantization block. Scale tensors:

    1x128 along columns (activations, output gradients): s (M, cdiv(C, 128)), q (M, C)
    128 tokens per column (weight gradient operands):    s (T, C) per row tile, q transposed (C, M)
    128x128 (weights (E, N, K)):                          s (E, cdiv(N, 128), cdiv(K, 128))

Payload layouts are chosen so every fp8 `tl.dot` operand is contiguous along its contraction
(Hopper's fp8 wgmma reads only K-major operands): the weight is stored transposed for the input gradient,
and the weight gradient's operands transposed (tokens contiguous). Strides are arguments throughout.

- `quantize_rows_kernel`: one program per (row tile, 128 columns): ROWWISE writes the 1x128 quantization,
  COLWISE the 128-token one, both from one read of the tile (the output gradient needs both).
- `quantize_weight_kernel`: one program per (expert, 128x128 block).
- `fp8_grouped_mm_kernel`: out[rows of e] = a[rows of e] @ b[e] with a's 1x128 and b's 128x128 scales,
  K stepped 128 at a time: each step's fp32 dot is scaled by a's row scales and b's column-block scales
  and added to the fp32 accumulator (DeepGEMM's and vLLM's w8a8 block kernel's "promotion").
- `fp8_grouped_wgrad_kernel`: out[e] = a[rows of e]^T @ b[rows of e] over the expert's row tiles, each
  tile's dot scaled by both operands' per-column scales of that tile.

Interpreter (TRITON_INTERPRET=1, triton 3.9): the fp32 -> e4m3 cast rounds wrongly when rounding carries
into the exponent (124.59 became 64, not 128), and an e4m3 x e4m3 dot returns garbage. So in the
interpreter `_to_e4m3` first rounds to the e4m3 grid in fp32 (exact, bit arithmetic; the cast of an
on-grid value is exact there) and `_fp8_dot` upcasts to fp32 (e4m3 products are exact in fp32). On the
GPU both are the hardware's round-to-nearest-even cast and fp8 wgmma.
"""

import triton
import triton.language as tl

from prime_rl.kernels.grouped_gemm.triton_kernels import INTERPRET

QBLOCK = 128
"""Quantization block edge, and the row tile of the grouped GEMMs (a tile is one 128-token block)."""
# jit code reads globals only as tl.constexpr instances (the compiler refuses others; the interpreter does not)
_QB = tl.constexpr(QBLOCK)
FP8_MAX = tl.constexpr(448.0)
AMAX_FLOOR = tl.constexpr(1e-4)
INTERPRET_FP8 = tl.constexpr(INTERPRET)

if INTERPRET:  # numpy runs each program: small output tiles, one config
    _MM_CONFIGS = [triton.Config({"BLOCK_N": 64})]
    _WGRAD_CONFIGS = [triton.Config({"BLOCK_N": 64, "BLOCK_K": 64})]
else:
    _MM_CONFIGS = [
        triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
        for bn, w, st in [(128, 8, 3), (128, 4, 4), (256, 8, 3), (64, 4, 4), (128, 8, 4)]
    ]
    _WGRAD_CONFIGS = [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bn, bk, w, st in [(128, 128, 8, 3), (128, 128, 4, 4), (64, 128, 4, 4), (128, 256, 8, 3)]
    ]


@triton.jit
def _to_e4m3(v):
    """fp32 already within [-448, 448] -> e4m3, round to nearest even."""
    if INTERPRET_FP8:
        bits = v.to(tl.uint32, bitcast=True)
        sign = bits & 0x80000000
        mag = bits & 0x7FFFFFFF
        # normals (|v| >= 2^-6): keep 3 mantissa bits, RNE on the 20 dropped ones (a carry bumps the exponent)
        normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        # subnormals: multiples of 2^-9; adding 1.5 * 2^14 (whose ulp is 2^-9) rounds there, RNE
        a = mag.to(tl.float32, bitcast=True)
        sub = (a + 24576.0) - 24576.0
        r = tl.where(a < 0.015625, sub, normal)
        v = (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return v.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _quantize(x, amax):
    """x (fp32 block), amax broadcastable -> (e4m3, scale); the torch reference's exact arithmetic."""
    # IEEE division (the GPU default is approximate) and NaN kept, as torch computes the reference
    scale = tl.div_rn(tl.maximum(amax, AMAX_FLOOR, propagate_nan=tl.PropagateNan.ALL), FP8_MAX)
    q = tl.clamp(tl.div_rn(x, scale), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return _to_e4m3(q), scale


@triton.jit
def _fp8_dot(a, b):
    if INTERPRET_FP8:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def quantize_rows_kernel(
    x_ptr,  # (M, C)
    q_ptr,  # ROWWISE: (M, C) e4m3
    s_ptr,  # ROWWISE: (M, cdiv(C, 128)) fp32
    qt_ptr,  # COLWISE: (C, M) e4m3 (tokens contiguous)
    st_ptr,  # COLWISE: (T, C) fp32, one row of scales per row tile
    ends_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    C,
    E,
    stride_xm,
    stride_xc,
    stride_qm,
    stride_qc,
    stride_sm,
    stride_sc,
    stride_qtc,
    stride_qtm,
    stride_stt,
    stride_stc,
    ROWWISE: tl.constexpr,
    COLWISE: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_c = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= E:
        return
    row_start = tl.load(tile_row_ptr + tile)
    row_end = tl.load(ends_ptr + expert).to(tl.int32)
    rows = row_start + tl.arange(0, _QB)
    cols = pid_c * _QB + tl.arange(0, _QB)
    mask = (rows < row_end)[:, None] & (cols < C)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :] * stride_xc, mask=mask, other=0.0)
    x = x.to(tl.float32)  # (128 rows, 128 cols); masked entries are the reference's zero padding
    if ROWWISE:
        q, s = _quantize(x, tl.max(tl.abs(x), axis=1)[:, None])  # s (128, 1)
        tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :] * stride_qc, q, mask=mask)
        tl.store(s_ptr + rows64[:, None] * stride_sm + pid_c * stride_sc, s, mask=(rows < row_end)[:, None])
    if COLWISE:
        q, s = _quantize(x, tl.max(tl.abs(x), axis=0)[None, :])  # s (1, 128)
        # int64: the transposed payload's offsets reach C * M (2^31 at 1M routed rows x 2048)
        tl.store(qt_ptr + cols[None, :].to(tl.int64) * stride_qtc + rows64[:, None] * stride_qtm, q, mask=mask)
        tl.store(st_ptr + tile * stride_stt + cols[None, :] * stride_stc, s, mask=(cols < C)[None, :])


@triton.jit
def quantize_weight_kernel(
    w_ptr,  # (E, N, K)
    q_ptr,  # (E, N, K) e4m3 at the given strides (the input gradient's copy is stored transposed)
    s_ptr,  # (E, cdiv(N, 128), cdiv(K, 128)) fp32
    N,
    K,
    stride_we,
    stride_wn,
    stride_wk,
    stride_qe,
    stride_qn,
    stride_qk,
    stride_se,
    stride_sn,
    stride_sk,
):
    expert = tl.program_id(1).to(tl.int64)
    k_blocks = tl.cdiv(K, _QB)
    pid_n = tl.program_id(0) // k_blocks
    pid_k = tl.program_id(0) % k_blocks
    ns = pid_n * _QB + tl.arange(0, _QB)
    ks = pid_k * _QB + tl.arange(0, _QB)
    mask = (ns < N)[:, None] & (ks < K)[None, :]
    w = tl.load(w_ptr + expert * stride_we + ns[:, None] * stride_wn + ks[None, :] * stride_wk, mask=mask, other=0.0)
    q, s = _quantize(w.to(tl.float32), tl.max(tl.max(tl.abs(w.to(tl.float32)), axis=1), axis=0))
    tl.store(q_ptr + expert * stride_qe + ns[:, None] * stride_qn + ks[None, :] * stride_qk, q, mask=mask)
    tl.store(s_ptr + expert * stride_se + pid_n * stride_sn + pid_k * stride_sk, s)


@triton.autotune(configs=_MM_CONFIGS, key=["N", "K", "E"])
@triton.jit
def fp8_grouped_mm_kernel(
    a_ptr,  # (M, K) e4m3
    as_ptr,  # (M, cdiv(K, 128)) fp32
    b_ptr,  # (E, K, N) e4m3, any strides (K-contiguous is the fast one)
    bs_ptr,  # (E, cdiv(K, 128), cdiv(N, 128)) fp32, any strides
    out_ptr,  # (M, N)
    ends_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    N,
    K,
    E,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_be,
    stride_bk,
    stride_bn,
    stride_bse,
    stride_bsk,
    stride_bsn,
    stride_om,
    stride_on,
    BLOCK_N: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= E:
        return  # padding program of the worst-case grid
    row_start = tl.load(tile_row_ptr + tile)
    row_end = tl.load(ends_ptr + expert).to(tl.int32)
    rows = row_start + tl.arange(0, _QB)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, _QB)
    row_mask = rows < row_end
    col_mask = cols < N
    rows64 = rows.to(tl.int64)
    expert64 = expert.to(tl.int64)
    a_ptrs = a_ptr + rows64[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + expert64 * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    as_ptrs = as_ptr + rows64 * stride_asm  # (128,) one scale per row and K block
    bs_ptrs = bs_ptr + expert64 * stride_bse + (cols // _QB) * stride_bsn  # (BLOCK_N,) per column block
    acc = tl.zeros((_QB, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, _QB)):
        k_mask = (kb * _QB + ks) < K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb * stride_ask, mask=row_mask, other=0.0)
        b_s = tl.load(bs_ptrs + kb * stride_bsk, mask=col_mask, other=0.0)
        acc += _fp8_dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += _QB * stride_ak
        b_ptrs += _QB * stride_bk
    out_ptrs = out_ptr + rows64[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.autotune(configs=_WGRAD_CONFIGS, key=["N", "K", "E"])
@triton.jit
def fp8_grouped_wgrad_kernel(
    at_ptr,  # (N, M) e4m3: a transposed, tokens contiguous
    ats_ptr,  # (T, N) fp32: a's 128-token scales per row tile
    bt_ptr,  # (K, M) e4m3
    bts_ptr,  # (T, K) fp32
    out_ptr,  # (E, N, K): out[e] = a[rows of e]^T @ b[rows of e]
    ends_ptr,
    first_tile_ptr,  # (E,) int32: the row tile where each expert's rows start
    N,
    K,
    E,
    stride_atn,
    stride_atm,
    stride_atst,
    stride_atsn,
    stride_btk,
    stride_btm,
    stride_btst,
    stride_btsk,
    stride_oe,
    stride_on,
    stride_ok,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert = tl.program_id(1)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_n = tl.program_id(0) % n_tiles
    pid_k = tl.program_id(0) // n_tiles
    row_end = tl.load(ends_ptr + expert).to(tl.int32)
    row_start = 0
    if expert > 0:
        row_start = tl.load(ends_ptr + expert - 1).to(tl.int32)
    tile = tl.load(first_tile_ptr + expert)

    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    ms = tl.arange(0, _QB)
    n_mask = ns < N
    k_mask = ks < K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(row_start, row_end, _QB):  # one expert's row tiles: one token block each
        rows = (m0 + ms).to(tl.int64)
        m_mask = rows < row_end
        a = tl.load(  # (BLOCK_N, 128)
            at_ptr + ns[:, None].to(tl.int64) * stride_atn + rows[None, :] * stride_atm,  # int64: N * M
            mask=n_mask[:, None] & m_mask[None, :],
            other=0.0,
        )
        b = tl.load(  # (BLOCK_K, 128), transposed in registers to (128, BLOCK_K)
            bt_ptr + ks[:, None].to(tl.int64) * stride_btk + rows[None, :] * stride_btm,
            mask=k_mask[:, None] & m_mask[None, :],
            other=0.0,
        )
        a_s = tl.load(ats_ptr + tile * stride_atst + ns * stride_atsn, mask=n_mask, other=0.0)
        b_s = tl.load(bts_ptr + tile * stride_btst + ks * stride_btsk, mask=k_mask, other=0.0)
        acc += _fp8_dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
        tile += 1
    out_ptrs = out_ptr + expert.to(tl.int64) * stride_oe + ns[:, None] * stride_on + ks[None, :] * stride_ok
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])
