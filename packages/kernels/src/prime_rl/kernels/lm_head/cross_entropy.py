"""`fused_nll_sum`: the LM head's summed negative log-likelihood for SFT, gradients computed in the forward.

SFT needs one number from the LM head, -sum_t logprob[t], and its gradient. Because that loss is a
sum, d loss / d logits does not depend on anything downstream except one scalar (the loss's own
upstream gradient), so it can be computed while the logits are at hand: per chunk of tokens

    z = h_c @ W^T                      (cuBLAS, [c, V] in the input dtype, the only logits buffer)
    row pass: lse, logprob, and z <- dL/dz = (softmax(z / temperature) - onehot(y)) / temperature
    grad_hidden[c] = dz @ W            (cuBLAS, written once: token chunks are disjoint)
    grad_weight   += dz^T @ h_c        (cuBLAS addmm into the gradient)

and backward only scales the two stored gradients by the upstream scalar. That is three [T, H] x [H, V]
matmuls per step instead of the four of `fused_logprobs_entropy` (forward, recompute, dW, dh), and no
entropy statistics: the same scheme as Liger's fused linear cross-entropy. RL cannot use it: its loss
weighs each token's logprob by a quantity that depends on the logprob itself.

Memory beyond the inputs: one [c, V] logits buffer (``chunk_size`` tokens; by default 256 MiB or about
the size of the hidden states, whichever is larger, see ``default_chunk_size``) plus the two gradients
(which the optimizer needs anyway), kept from forward to backward and scaled in place there. With bf16 weights and more than one token chunk,
the weight gradient accumulates in bf16 (one rounding per chunk, as Liger does); fp32 weights accumulate
in fp32.

The row pass is a Triton kernel on CUDA (one program per token: an online max / sum over the vocabulary,
then one pass writing the gradient over the logits in place) and plain torch elsewhere.
Ignored targets (< 0) contribute nothing to the loss or to any gradient.
"""

from __future__ import annotations

import torch

from prime_rl.kernels.lm_head.math import check_inputs

LOGITS_BUFFER_BYTES = 256 << 20
"""Bound on the [chunk, V] logits buffer when ``chunk_size`` is not given."""


def default_chunk_size(vocab: int, itemsize: int, tokens: int = 0, hidden: int = 0) -> int:
    """Tokens per logits chunk: the largest power of two c with c * vocab * itemsize <= LOGITS_BUFFER_BYTES
    (at least 16), raised to the power of two at or above tokens * hidden / vocab when that is larger
    (the buffer then holds about as many elements as the hidden states [T, H]).

    Why grow with T: every chunk reads and writes the whole [V, H] weight gradient once (the addmm), so
    at T = 65536 chunks of 512 tokens moved 155 GB through HBM for it; chunks of 1024 halve that."""
    rows = max(1, LOGITS_BUFFER_BYTES // (vocab * itemsize))
    chunk = max(16, 1 << (rows.bit_length() - 1))
    per_hidden = -(-tokens * hidden // vocab)
    if per_hidden > chunk:
        chunk = 1 << (per_hidden - 1).bit_length()
    return chunk


def ce_rows_torch(z: torch.Tensor, targets: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    """Row pass in torch: returns logprobs [c] (fp32, 0 where ignored) and overwrites ``z`` [c, V] with
    dL/dz for L = -sum(logprobs) (zero rows where ignored)."""
    zf = z.float() * inv_temperature
    lse = torch.logsumexp(zf, dim=1)
    valid = targets >= 0
    safe = torch.where(valid, targets, torch.zeros_like(targets)).long()
    logprobs = torch.where(valid, zf.gather(1, safe[:, None]).squeeze(1) - lse, torch.zeros_like(lse))
    grad = torch.exp(zf - lse[:, None])
    grad.scatter_add_(1, safe[:, None], -torch.ones_like(lse)[:, None])
    grad.mul_(torch.where(valid, inv_temperature, 0.0)[:, None])
    z.copy_(grad)
    return logprobs


def _ce_rows(z: torch.Tensor, targets: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    if z.is_cuda:
        from prime_rl.kernels.lm_head.api import triton_available

        if triton_available():
            from prime_rl.kernels.lm_head.triton_kernels import ce_rows_triton

            return ce_rows_triton(z, targets, inv_temperature)
    return ce_rows_torch(z, targets, inv_temperature)


class _FusedNLLSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size):
        T = hidden.shape[0]
        V = weight.shape[0]
        inv_t = 1.0 / temperature
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros_like(weight) if need_w else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        rows = min(T, chunk_size)
        buf = torch.empty((rows, V), dtype=hidden.dtype, device=hidden.device)
        for t0 in range(0, T, chunk_size):
            t1 = min(t0 + chunk_size, T)
            h = hidden[t0:t1]
            z = buf[: t1 - t0]
            torch.mm(h, weight.T, out=z)
            loss -= _ce_rows(z, targets[t0:t1], inv_t).sum()
            if grad_hidden is not None:
                torch.mm(z, weight, out=grad_hidden[t0:t1])
            if grad_weight is not None:
                grad_weight.addmm_(z.T, h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.backward_done = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.backward_done:
            raise RuntimeError(
                "fused_nll_sum's backward ran twice on one forward (retain_graph=True): its gradients are "
                "computed once in the forward and scaled in place; call fused_nll_sum again instead"
            )
        ctx.backward_done = True
        grad_hidden, grad_weight = ctx.saved_tensors
        # in place: a scaled copy of the [V, H] weight gradient would double its memory at the peak
        if grad_hidden is not None:
            grad_hidden.mul_(grad_loss)
        if grad_weight is not None:
            grad_weight.mul_(grad_loss)
        return grad_hidden, grad_weight, None, None, None


def fused_nll_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """-sum over non-ignored tokens of log_softmax(hidden @ weight.T / temperature)[target], fp32 scalar.

    hidden [T, H], weight [V, H] (same dtype), targets [T] (negative = ignored). Differentiable w.r.t.
    hidden and weight; the gradients are computed in this call (see the module docstring), so call it
    with grad enabled only when you will backpropagate. Target ids >= V are not checked on CUDA.
    """
    check_inputs(hidden, weight, targets, temperature)
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0], weight.element_size(), hidden.shape[0], hidden.shape[1])
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1 tokens per logits chunk")
    return _FusedNLLSum.apply(
        hidden.contiguous(), weight.contiguous(), targets.contiguous(), float(temperature), chunk_size
    )
