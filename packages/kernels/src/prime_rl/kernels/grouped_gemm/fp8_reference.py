"""Blockwise FP8 quantization in plain torch: the recipe's definition, and the reference the Triton kernels
(`fp8_triton_kernels.py`) are tested against. DeepSeek-V3's recipe: e4m3 payloads with one fp32 scale per
1x128 block of an activation or gradient row (along the contraction) and per 128x128 block of a weight.

A scale is the block's amax / 448 (e4m3's largest finite value), amax floored at AMAX_FLOOR like DeepGEMM's
casts, so an all-zero block gets a finite scale and quantizes to zeros; a NaN or Inf input stays NaN (a loss
that goes NaN is found, one that was clamped is not). Dimensions that are not multiples of 128 are
zero-padded to the next block, which changes no product.
"""

import torch
import torch.nn.functional as F

BLOCK = 128
"""Scale block edge: 1x128 for activations and gradients, 128x128 for weights."""
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
AMAX_FLOOR = 1e-4
"""Smallest amax a scale is computed from: an all-zero block gets scale 1e-4 / 448, not 0 / 0."""


def _pad_to_block(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Zero-pad the given dims of x up to a multiple of BLOCK (a view-free copy only when needed)."""
    pad = [0] * (2 * x.dim())
    for d in dims:
        pad[2 * (x.dim() - 1 - d) + 1] = -x.shape[d] % BLOCK
    return F.pad(x, pad) if any(pad) else x


def _to_fp8(blocks: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX  # NaN amax stays NaN: clamp passes it through
    # the clamp only catches rounding of amax / scale just above 448 (the cast's overflow differs by device)
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> q (M, Kp) e4m3, scale (M, Kp / 128) fp32; Kp = K rounded up to 128 (zero columns),
    x[m, k] ~ q[m, k] * scale[m, k // 128]."""
    xp = _pad_to_block(x.float(), (1,)).contiguous()  # the weight gradient passes transposed views
    m, kp = xp.shape
    blocks = xp.view(m, kp // BLOCK, BLOCK)  # (M, Kb, 128)
    q, scale = _to_fp8(blocks, blocks.abs().amax(dim=-1, keepdim=True))
    return q.view(m, kp), scale.squeeze(-1)


def quantize_128x128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (E, N, K) -> q (E, Np, Kp) e4m3, scale (E, Np / 128, Kp / 128) fp32, both dims padded to 128."""
    wp = _pad_to_block(w.float(), (1, 2)).contiguous()
    e, np_, kp = wp.shape
    blocks = wp.view(e, np_ // BLOCK, BLOCK, kp // BLOCK, BLOCK)  # (E, Nb, 128, Kb, 128)
    q, scale = _to_fp8(blocks, blocks.abs().amax(dim=(2, 4), keepdim=True))
    return q.view(e, np_, kp), scale.view(e, np_ // BLOCK, kp // BLOCK)


def dequantize_1x128(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(M, Kp) e4m3, (M, Kp / 128) -> (M, Kp) fp32."""
    return (q.float().unflatten(-1, (-1, BLOCK)) * scale.unsqueeze(-1)).flatten(-2)


def dequantize_128x128(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(E, Np, Kp) e4m3, (E, Np / 128, Kp / 128) -> (E, Np, Kp) fp32."""
    full = scale.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return q.float() * full
