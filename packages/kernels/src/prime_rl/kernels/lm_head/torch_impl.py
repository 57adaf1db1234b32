"""Chunked plain-torch LM head: token logprobs and entropy without a [T, V] logits tensor.

Runs anywhere (CPU, CUDA without Triton) and is the reference for the Triton kernel. Forward
streams over `chunk_size` tokens and `vocab_block` vocabulary columns with an online log-sum-exp;
only a [chunk_size, vocab_block] block of logits exists at a time. Backward recomputes each block
from the saved (hidden, weight, targets, lse, S). Matmuls run in float32 (float64 for float64
inputs) so that this path is accurate enough to serve as a reference; weight gradients accumulate
in that dtype and are cast once at the end.
"""

import functools

import torch

from prime_rl.kernels.lm_head.function import BackwardInputs, LMHeadFunction
from prime_rl.kernels.lm_head.math import (
    DEFAULT_CHUNK_SIZE,
    check_inputs,
    finalize_stats,
    logit_grad,
    merge_lse_stats,
)

DEFAULT_VOCAB_BLOCK = 8192


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _block_logits(h: torch.Tensor, w: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    dtype = _compute_dtype(h.dtype)
    return (h.to(dtype) @ w.to(dtype).T) * inv_temperature  # (c, v)


def _local_targets(targets: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
    inside = (targets >= v0) & (targets < v1)
    return torch.where(inside, targets - v0, torch.full_like(targets, -1))


def torch_forward_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    inv_temperature: float,
    chunk_size: int,
    vocab_block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (logprobs, entropy, lse, S), each [T] in the compute dtype."""
    T, V = hidden.shape[0], weight.shape[0]
    dtype = _compute_dtype(hidden.dtype)
    outs: list[tuple[torch.Tensor, ...]] = []
    for t0 in range(0, T, chunk_size):
        h = hidden[t0 : t0 + chunk_size]
        tgt = targets[t0 : t0 + chunk_size]
        c = h.shape[0]
        m = torch.full((c,), float("-inf"), dtype=dtype, device=hidden.device)
        s = torch.zeros(c, dtype=dtype, device=hidden.device)
        sz = torch.zeros_like(s)
        z_target = torch.zeros_like(s)
        for v0 in range(0, V, vocab_block):
            v1 = min(v0 + vocab_block, V)
            z = _block_logits(h, weight[v0:v1], inv_temperature)  # (c, v)
            m_blk = z.max(dim=1).values
            e = torch.exp(z - m_blk[:, None])
            m, s, sz = merge_lse_stats(m, s, sz, m_blk, e.sum(1), (e * z).sum(1))
            local = _local_targets(tgt, v0, v1)
            hit = local >= 0
            z_target = torch.where(hit, z.gather(1, local.clamp(min=0)[:, None]).squeeze(1), z_target)
        outs.append(finalize_stats(m, s, sz, z_target, tgt))
    if not outs:  # T == 0
        empty = torch.zeros(0, dtype=dtype, device=hidden.device)
        return empty, empty.clone(), empty.clone(), empty.clone()
    return tuple(torch.cat(parts) for parts in zip(*outs))  # type: ignore[return-value]


def torch_backward(
    inputs: BackwardInputs, chunk_size: int, vocab_block: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    hidden, weight, targets, lse, sum_pz, grad_logprobs, grad_entropy, inv_temperature, need_h, need_w = inputs
    T, V = hidden.shape[0], weight.shape[0]
    dtype = _compute_dtype(hidden.dtype)
    grad_logprobs = grad_logprobs.to(dtype)
    grad_entropy = grad_entropy.to(dtype)
    grad_hidden = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if need_h else None
    grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
    for t0 in range(0, T, chunk_size):
        t1 = min(t0 + chunk_size, T)
        h = hidden[t0:t1]
        h_c = h.to(dtype)
        for v0 in range(0, V, vocab_block):
            v1 = min(v0 + vocab_block, V)
            w_c = weight[v0:v1].to(dtype)
            z = _block_logits(h, weight[v0:v1], inv_temperature)
            local = _local_targets(targets[t0:t1], v0, v1)
            dlogits = logit_grad(
                z, lse[t0:t1], sum_pz[t0:t1], grad_logprobs[t0:t1], grad_entropy[t0:t1], local, inv_temperature
            )  # (c, v)
            if grad_hidden is not None:
                grad_hidden[t0:t1] += dlogits @ w_c
            if grad_weight is not None:
                grad_weight[v0:v1] += dlogits.T @ h_c
    return (
        None if grad_hidden is None else grad_hidden.to(hidden.dtype),
        None if grad_weight is None else grad_weight.to(weight.dtype),
    )


def fused_logprobs_entropy_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_block: int = DEFAULT_VOCAB_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked torch LM head. Returns (logprobs [T] fp32, entropy [T] fp32); negative targets get logprob 0.

    Out-of-range targets (>= V) raise here; the Triton path does not check them (that would sync the GPU).
    """
    check_inputs(hidden, weight, targets, temperature)
    if chunk_size < 1 or vocab_block < 1:
        raise ValueError(f"chunk_size={chunk_size} and vocab_block={vocab_block} must be >= 1")
    if targets.numel() and int(targets.max()) >= weight.shape[0]:
        raise ValueError(
            f"target id {int(targets.max())} >= vocab size {weight.shape[0]}; use ids in [0, V) or -100 to ignore"
        )
    chunk_size, vocab_block = int(chunk_size), int(vocab_block)
    stats = functools.partial(torch_forward_stats, chunk_size=chunk_size, vocab_block=vocab_block)
    backward = functools.partial(torch_backward, chunk_size=chunk_size, vocab_block=vocab_block)
    return LMHeadFunction.apply(hidden, weight, targets, float(temperature), stats, backward)
