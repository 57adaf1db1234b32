"""Triton LM head: autograd wiring around triton_kernels.py.

Memory (beyond inputs and gradients): forward keeps 4 x [NSPLIT, T] floats; backward keeps a
float32 dh accumulator [T, H], one dL/dlogits buffer [min(T, chunk_size), vocab_block] in the
input dtype (vocab_block ~ 2^27 / chunk rows, i.e. <= 256 MiB in bf16) and, when T > chunk_size,
a float32 [vocab_block, H] dW accumulator. No [T, V] tensor is ever allocated.

Backward loops vocab blocks outside and token chunks inside, so with T <= chunk_size every weight
row's gradient is one cuBLAS matmul written straight into grad_weight (fp32 accumulation, one
rounding), as in the vanilla head.
"""

import functools

import torch
import triton

from prime_rl.kernels.lm_head.function import BackwardInputs, LMHeadFunction
from prime_rl.kernels.lm_head.math import DEFAULT_CHUNK_SIZE, check_inputs, finalize_stats
from prime_rl.kernels.lm_head.triton_kernels import lm_head_dlogits_kernel, lm_head_fwd_kernel

# Elements of one dL/dlogits buffer (2^27 = 256 MiB in bf16).
DLOGITS_BUFFER_ELEMENTS = 1 << 27
_VOCAB_ALIGN = 256


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs are the accuracy path: keep full fp32 products instead of TF32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _num_splits(T: int, V: int, device: torch.device) -> int:
    # Enough programs for ~8 waves; never more splits than 128-wide vocab tiles.
    token_tiles = triton.cdiv(T, 128)
    return max(1, min(triton.cdiv(8 * _num_sms(device), token_tiles), triton.cdiv(V, 128)))


def triton_forward_stats(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inv_temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    T, HID = hidden.shape
    V = weight.shape[0]
    nsplit = _num_splits(T, V, hidden.device)
    stats = torch.empty((4, nsplit, T), dtype=torch.float32, device=hidden.device)
    if T:

        def grid(meta):
            return (triton.cdiv(T, meta["BLOCK_T"]) * nsplit,)

        lm_head_fwd_kernel[grid](
            hidden,
            weight,
            targets,
            stats[0],
            stats[1],
            stats[2],
            stats[3],
            T,
            V,
            HID,
            inv_temperature,
            hidden.stride(0),
            weight.stride(0),
            nsplit,
            DOT_PRECISION=_dot_precision(hidden.dtype),
        )
    m_part, s_part, sz_part, zt_part = stats  # (nsplit, T) each
    m = m_part.max(dim=0).values
    scale = torch.exp(m_part - m)  # empty splits have m = -inf -> scale 0
    s = (s_part * scale).sum(0)
    sz = (sz_part * scale).sum(0)
    return finalize_stats(m, s, sz, zt_part.sum(0), targets)


def _vocab_block(rows: int, V: int) -> int:
    vb = max(_VOCAB_ALIGN, DLOGITS_BUFFER_ELEMENTS // max(rows, 1) // _VOCAB_ALIGN * _VOCAB_ALIGN)
    return min(vb, V)


def triton_backward(inputs: BackwardInputs, chunk_size: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    hidden, weight, targets, lse, sum_pz, grad_logprobs, grad_entropy, inv_temperature, need_h, need_w = inputs
    T, HID = hidden.shape
    V = weight.shape[0]
    glp = grad_logprobs.float().contiguous()
    gent = grad_entropy.float().contiguous()
    grad_hidden = torch.zeros((T, HID), dtype=torch.float32, device=hidden.device) if need_h else None
    grad_weight = None
    if need_w:
        # Every row is written below unless there are no tokens.
        grad_weight = torch.empty_like(weight) if T else torch.zeros_like(weight)
    rows = min(T, chunk_size)
    vb_max = _vocab_block(rows, V)
    buf = torch.empty((rows, vb_max), dtype=hidden.dtype, device=hidden.device)
    precision = _dot_precision(hidden.dtype)
    single_chunk = T <= chunk_size
    for v0 in range(0, V, vb_max):
        v1 = min(v0 + vb_max, V)
        w_blk = weight[v0:v1]
        gw_acc = None if single_chunk or grad_weight is None else torch.zeros_like(w_blk, dtype=torch.float32)
        for t0 in range(0, T, chunk_size):
            t1 = min(t0 + chunk_size, T)
            h = hidden[t0:t1]
            dz = buf[: t1 - t0, : v1 - v0]  # (c, vb) strided view into the buffer

            def grid(meta, c=t1 - t0, vb=v1 - v0):
                return (triton.cdiv(c, meta["BLOCK_T"]) * triton.cdiv(vb, meta["BLOCK_V"]),)

            lm_head_dlogits_kernel[grid](
                h,
                w_blk,
                targets[t0:t1],
                lse[t0:t1],
                sum_pz[t0:t1],
                glp[t0:t1],
                gent[t0:t1],
                dz,
                t1 - t0,
                v1 - v0,
                HID,
                v0,
                inv_temperature,
                h.stride(0),
                w_blk.stride(0),
                dz.stride(0),
                DOT_PRECISION=precision,
            )
            if grad_hidden is not None:
                grad_hidden[t0:t1] += dz @ w_blk
            if grad_weight is not None:
                if gw_acc is None:
                    torch.mm(dz.T, h, out=grad_weight[v0:v1])
                else:
                    gw_acc += dz.T @ h
        if gw_acc is not None:
            grad_weight[v0:v1] = gw_acc
    return (None if grad_hidden is None else grad_hidden.to(hidden.dtype)), grad_weight


def fused_logprobs_entropy_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton LM head. Same contract as fused_logprobs_entropy_torch; target ids >= V are not checked."""
    check_inputs(hidden, weight, targets, temperature)
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    if hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype {hidden.dtype} is not supported by the Triton path; use bf16, fp16 or fp32")
    backward = functools.partial(triton_backward, chunk_size=int(chunk_size))
    contiguous = (hidden.contiguous(), weight.contiguous(), targets.contiguous())
    return LMHeadFunction.apply(*contiguous, float(temperature), triton_forward_stats, backward)
