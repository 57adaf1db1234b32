"""Triton kernels for the fused LM head (imported only when triton is importable).

Forward (`lm_head_fwd_kernel`): each program owns BLOCK_T tokens and a contiguous 1/NSPLIT share
of the vocabulary tiles. Per tile it computes z = h @ W_tile^T / temperature in registers (tl.dot,
fp32 accumulate) and folds it into an online (max, sum e^(z-max), sum e^(z-max) z, z[target])
per token; logits never reach memory. The NSPLIT partials per token are merged in torch ([NSPLIT, T]
floats, tiny). Programs are ordered split-fastest so that the programs running at the same time
share a few token tiles (kept in L2) and stream the same weight tiles.

Backward (`lm_head_dlogits_kernel`): recomputes one [tokens, vocab block] tile of z, turns it into
dL/dlogits with the saved lse and S (see math.py) and stores it in the input dtype; the two large
matmuls (dW = dlogits^T h, dh = dlogits W) then run in cuBLAS.

Set TRITON_INTERPRET=1 before importing to run these kernels on CPU (tests do, on small shapes).
"""

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
INTERPRET_DOT_UPCAST = tl.constexpr(INTERPRET)

if INTERPRET:
    # The interpreter runs each program in numpy: small tiles keep tests fast, one config skips autotuning.
    _FWD_CONFIGS = [triton.Config({"BLOCK_T": 32, "BLOCK_V": 64, "BLOCK_K": 32})]
    _BWD_CONFIGS = [triton.Config({"BLOCK_T": 32, "BLOCK_V": 64, "BLOCK_K": 32, "GROUP_T": 2})]
else:
    _FWD_CONFIGS = [
        triton.Config({"BLOCK_T": 128, "BLOCK_V": bv, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bv, bk, w, st in [(128, 64, 8, 3), (128, 64, 4, 4), (256, 64, 8, 3), (128, 128, 8, 3)]
    ]
    _BWD_CONFIGS = [
        triton.Config({"BLOCK_T": bt, "BLOCK_V": bv, "BLOCK_K": 64, "GROUP_T": 8}, num_warps=w, num_stages=st)
        for bt, bv, w, st in [(128, 128, 8, 3), (128, 128, 4, 4), (128, 256, 8, 3), (256, 128, 8, 3)]
    ]


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr):
    if INTERPRET_DOT_UPCAST:
        # The interpreter's bf16 x bf16 -> fp32 dot is wrong (triton 3.9); bf16 products are exact in fp32.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.autotune(configs=_FWD_CONFIGS, key=["V", "HID", "NSPLIT", "DOT_PRECISION"])
@triton.jit
def lm_head_fwd_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    m_ptr,  # (NSPLIT, T) running max of z
    s_ptr,  # (NSPLIT, T) sum exp(z - m)
    sz_ptr,  # (NSPLIT, T) sum exp(z - m) * z
    zt_ptr,  # (NSPLIT, T) z[target] if the target falls in this split, else 0
    T,
    V,
    HID,
    inv_temp,
    stride_h,
    stride_w,
    NSPLIT,
    DOT_PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_s = pid % NSPLIT
    pid_t = pid // NSPLIT
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    ks = tl.arange(0, BLOCK_K)

    n_vt = tl.cdiv(V, BLOCK_V)
    per_split = tl.cdiv(n_vt, NSPLIT)
    vt_start = pid_s * per_split
    vt_end = tl.minimum(vt_start + per_split, n_vt)

    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_T], tl.float32)
    sz = tl.zeros([BLOCK_T], tl.float32)
    zt = tl.zeros([BLOCK_T], tl.float32)
    for vt in range(vt_start, vt_end):
        cols = vt * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
        for k in range(0, HID, BLOCK_K):
            kk = k + ks
            a = tl.load(
                h_ptr + rows[:, None] * stride_h + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < HID), other=0.0
            )  # (BT, BK)
            b = tl.load(
                w_ptr + cols[None, :] * stride_w + kk[:, None], mask=col_ok[None, :] & (kk[:, None] < HID), other=0.0
            )  # (BK, BV)
            acc = _dot(a, b, acc, DOT_PRECISION)
        z = tl.where(col_ok[None, :], acc * inv_temp, float("-inf"))  # (BT, BV)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        e = tl.exp(z - m_new[:, None])
        alpha = tl.exp(m - m_new)
        s = s * alpha + tl.sum(e, axis=1)
        sz = sz * alpha + tl.sum(e * tl.where(col_ok[None, :], z, 0.0), axis=1)
        zt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
        m = m_new

    out = pid_s * T + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(sz_ptr + out, sz, mask=row_ok)
    tl.store(zt_ptr + out, zt, mask=row_ok)


@triton.autotune(configs=_BWD_CONFIGS, key=["VB", "HID", "DOT_PRECISION"])
@triton.jit
def lm_head_dlogits_kernel(
    h_ptr,  # (T, HID) token chunk
    w_ptr,  # (VB, HID) vocab block, rows v_start .. v_start + VB of the weight
    tgt_ptr,  # (T,) global target ids
    lse_ptr,
    spz_ptr,  # (T,) S = sum p z
    glp_ptr,  # (T,) upstream grad of logprobs (0 for ignored targets)
    gent_ptr,  # (T,) upstream grad of entropy
    dz_ptr,  # (T, VB) out: dL/dlogits in the input dtype
    T,
    VB,
    HID,
    v_start,
    inv_temp,
    stride_h,
    stride_w,
    stride_dz,
    DOT_PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_T: tl.constexpr,
):
    # Grouped tile order (as in Triton's matmul tutorial) for L2 reuse of h and W tiles.
    pid = tl.program_id(0)
    n_t = tl.cdiv(T, BLOCK_T)
    n_v = tl.cdiv(VB, BLOCK_V)
    per_group = GROUP_T * n_v
    first_t = (pid // per_group) * GROUP_T
    group_size = tl.minimum(n_t - first_t, GROUP_T)
    pid_t = first_t + (pid % per_group) % group_size
    pid_v = (pid % per_group) // group_size

    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < T
    col_ok = cols < VB
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
    for k in range(0, HID, BLOCK_K):
        kk = k + ks
        a = tl.load(
            h_ptr + rows[:, None] * stride_h + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < HID), other=0.0
        )
        b = tl.load(
            w_ptr + cols[None, :] * stride_w + kk[:, None], mask=col_ok[None, :] & (kk[:, None] < HID), other=0.0
        )
        acc = _dot(a, b, acc, DOT_PRECISION)
    z = acc * inv_temp  # (BT, BV)

    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    spz = tl.load(spz_ptr + rows, mask=row_ok, other=0.0)
    glp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
    gent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    p = tl.exp(z - lse[:, None])
    dz = p * (-glp[:, None] - gent[:, None] * (z - spz[:, None]))
    dz += tl.where((v_start + cols)[None, :] == tgt[:, None], glp[:, None], 0.0)
    dz = dz * inv_temp
    tl.store(
        dz_ptr + rows[:, None] * stride_dz + cols[None, :],
        dz.to(dz_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def ce_rows_kernel(
    z_ptr,  # (C, V) logits in the input dtype; overwritten with dL/dz for L = -sum(logprob)
    tgt_ptr,  # (C,) target ids, < 0 = ignored
    lp_ptr,  # (C,) out: fp32 logprob (0 where ignored)
    ent_ptr,  # (C,) out: fp32 entropy of the row's distribution (written only WITH_ENTROPY)
    V,
    stride_z,
    inv_temp,
    BLOCK_V: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
):
    # One program per token row: an online (max, sum) pass over the vocabulary, then one pass writing
    # (softmax - onehot) / temperature over the logits in place (the cross-entropy row of fused_nll_sum).
    # The entropy, lse - sum_j p_j z_j, rides on the second pass: it reads every p_j and z_j already.
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride_z
    tgt = tl.load(tgt_ptr + row)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, z)
        s = s * tl.exp(m - m_new) + tl.exp(z - m_new)  # lanes still at -inf stay 0 (exp(-inf) = 0)
        s = tl.where(m_new == float("-inf"), 0.0, s)
        m = m_new
    m_row = tl.max(m, axis=0)
    lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), axis=0))
    valid = tgt >= 0
    scale = tl.where(valid, inv_temp, 0.0)
    z_t = tl.load(base + tl.where(valid, tgt, 0)).to(tl.float32) * inv_temp
    tl.store(lp_ptr + row, tl.where(valid, z_t - lse, 0.0))
    pz = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = cols < V
        z = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32) * inv_temp
        p = tl.exp(z - lse)
        if WITH_ENTROPY:
            pz += tl.where(ok, p * z, 0.0)
        g = (p - tl.where(cols == tgt, 1.0, 0.0)) * scale
        tl.store(base + cols, g.to(z_ptr.dtype.element_ty), mask=ok)
    if WITH_ENTROPY:
        tl.store(ent_ptr + row, lse - tl.sum(pz, axis=0))


def ce_rows_triton(z, targets, inv_temperature: float, entropy=None):
    """Triton row pass of the fused heads (see cross_entropy.py): logprobs [C] fp32, ``z`` overwritten;
    ``entropy`` ([C] fp32), when given, receives each row's entropy."""
    import torch

    rows, vocab = z.shape
    logprobs = torch.empty(rows, dtype=torch.float32, device=z.device)
    if rows:
        ce_rows_kernel[(rows,)](
            z,
            targets,
            logprobs,
            logprobs if entropy is None else entropy,
            vocab,
            z.stride(0),
            inv_temperature,
            BLOCK_V=4096 if not INTERPRET else 64,
            WITH_ENTROPY=entropy is not None,
            num_warps=16 if not INTERPRET else 1,
        )
    return logprobs
