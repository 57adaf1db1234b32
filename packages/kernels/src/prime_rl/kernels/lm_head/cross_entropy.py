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
entropy statistics: the same scheme as Liger's fused linear cross-entropy.

`fused_token_loss` does the same for any loss that is a sum of per-token terms, L = sum_t f_t(logprob_t),
such as RL's token-level importance-ratio loss: f_t may depend on the logprob itself (the ratio, its mask),
which is known once the row pass has run. Per chunk the caller's ``token_loss`` gets the chunk's logprobs
(a leaf), autograd gives g_t = f_t'(logprob_t) on that [c] vector alone, and since the row pass left
dz = d(-logprob)/dz in the buffer, dL/dz = -g_t dz: the factor is folded into the [c, H] sides of the two
gradient matmuls (grad_hidden rows scaled after, h rows scaled before the addmm), never a pass over [c, V].
The row pass also returns the entropy (logged by RL, no gradient), from the p_j and z_j it reads anyway.
A loss whose token terms depend on other tokens' logprobs (GSPO's per-sample ratio) cannot use it.

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

from collections.abc import Callable

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


def ce_rows_torch(
    z: torch.Tensor, targets: torch.Tensor, inv_temperature: float, entropy: torch.Tensor | None = None
) -> torch.Tensor:
    """Row pass in torch: returns logprobs [c] (fp32, 0 where ignored) and overwrites ``z`` [c, V] with
    dL/dz for L = -sum(logprobs) (zero rows where ignored); ``entropy`` [c] fp32, when given, receives each
    row's entropy."""
    zf = z.float() * inv_temperature
    lse = torch.logsumexp(zf, dim=1)
    valid = targets >= 0
    safe = torch.where(valid, targets, torch.zeros_like(targets)).long()
    logprobs = torch.where(valid, zf.gather(1, safe[:, None]).squeeze(1) - lse, torch.zeros_like(lse))
    grad = torch.exp(zf - lse[:, None])
    if entropy is not None:
        entropy.copy_(lse - (grad * zf).sum(dim=1))
    grad.scatter_add_(1, safe[:, None], -torch.ones_like(lse)[:, None])
    grad.mul_(torch.where(valid, inv_temperature, 0.0)[:, None])
    z.copy_(grad)
    return logprobs


def _ce_rows(
    z: torch.Tensor, targets: torch.Tensor, inv_temperature: float, entropy: torch.Tensor | None = None
) -> torch.Tensor:
    if z.is_cuda:
        from prime_rl.kernels.lm_head.api import triton_available

        if triton_available():
            from prime_rl.kernels.lm_head.triton_kernels import ce_rows_triton

            return ce_rows_triton(z, targets, inv_temperature, entropy)
    return ce_rows_torch(z, targets, inv_temperature, entropy)


TokenLoss = Callable[[torch.Tensor, int, int], torch.Tensor]
"""``token_loss(logprobs, t0, t1)``: the loss terms of tokens t0..t1 summed, from their logprobs [t1 - t0] (fp32,
a leaf that requires grad); every term must depend on its own token's logprob only."""


def _chunk_factor(token_loss: TokenLoss, logprobs: torch.Tensor, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the chunk's loss, -dL/dlogprob [c] fp32): the factor that turns the row pass's d(-logprob)/dz into dL/dz."""
    leaf = logprobs.detach().requires_grad_()
    with torch.enable_grad():
        loss = token_loss(leaf, t0, t1)
    grad = torch.autograd.grad(loss, leaf, allow_unused=True)[0] if loss.requires_grad else None
    factor = torch.zeros_like(leaf) if grad is None else -grad  # None: no term reads a logprob
    return loss.detach().float(), factor


class _FusedHeadLoss(torch.autograd.Function):
    """The summed NLL (``token_loss`` None: loss only) or a caller's per-token loss (loss, logprobs, entropy)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, token_loss):
        T = hidden.shape[0]
        V = weight.shape[0]
        inv_t = 1.0 / temperature
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros_like(weight) if need_w else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        per_token = token_loss is not None
        logprobs = torch.empty(T, dtype=torch.float32, device=hidden.device) if per_token else None
        entropy = torch.empty(T, dtype=torch.float32, device=hidden.device) if per_token else None
        rows = min(T, chunk_size)
        buf = torch.empty((rows, V), dtype=hidden.dtype, device=hidden.device)
        for t0 in range(0, T, chunk_size):
            t1 = min(t0 + chunk_size, T)
            h = hidden[t0:t1]
            z = buf[: t1 - t0]
            torch.mm(h, weight.T, out=z)
            lp = _ce_rows(z, targets[t0:t1], inv_t, entropy[t0:t1] if per_token else None)
            factor = None
            if per_token:
                logprobs[t0:t1] = lp
                chunk_loss, factor = _chunk_factor(token_loss, lp, t0, t1)
                loss += chunk_loss
            else:
                loss -= lp.sum()
            if grad_hidden is not None:
                torch.mm(z, weight, out=grad_hidden[t0:t1])
                if factor is not None:
                    grad_hidden[t0:t1].mul_(factor[:, None])
            if grad_weight is not None:
                grad_weight.addmm_(z.T, h if factor is None else (h * factor[:, None]).to(h.dtype))
        # ctx attributes, not save_for_backward: they are the gradients themselves, read first thing in backward,
        # so saved-tensor hooks (activation offloading) must not copy them to the host and back
        ctx.grads = (grad_hidden, grad_weight)
        ctx.backward_done = False
        if not per_token:
            return loss
        ctx.mark_non_differentiable(logprobs, entropy)
        return loss, logprobs, entropy

    @staticmethod
    def backward(ctx, grad_loss, *_no_grad_outputs):
        if ctx.backward_done:
            raise RuntimeError(
                "the fused head's backward ran twice on one forward (retain_graph=True): its gradients are "
                "computed once in the forward and scaled in place; call fused_nll_sum / fused_token_loss again"
            )
        ctx.backward_done = True
        (grad_hidden, grad_weight), ctx.grads = ctx.grads, None
        # in place: a scaled copy of the [V, H] weight gradient would double its memory at the peak
        if grad_hidden is not None:
            grad_hidden.mul_(grad_loss)
        if grad_weight is not None:
            grad_weight.mul_(grad_loss)
        return grad_hidden, grad_weight, None, None, None, None


def _prepare(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float, chunk_size: int | None
) -> int:
    check_inputs(hidden, weight, targets, temperature)
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0], weight.element_size(), hidden.shape[0], hidden.shape[1])
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1 tokens per logits chunk")
    return chunk_size


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
    chunk_size = _prepare(hidden, weight, targets, temperature, chunk_size)
    return _FusedHeadLoss.apply(
        hidden.contiguous(), weight.contiguous(), targets.contiguous(), float(temperature), chunk_size, None
    )


def fused_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    token_loss: TokenLoss,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, logprobs, entropy): loss = sum over chunks of ``token_loss(logprobs[t0:t1], t0, t1)`` (fp32 scalar,
    differentiable w.r.t. hidden and weight, gradients computed in this call as for ``fused_nll_sum``); logprobs
    and entropy [T] fp32 of log_softmax(hidden @ weight.T / temperature), without gradient (ignored targets,
    < 0, give logprob 0 and no gradient). ``token_loss`` is called once per chunk, in order."""
    chunk_size = _prepare(hidden, weight, targets, temperature, chunk_size)
    return _FusedHeadLoss.apply(
        hidden.contiguous(), weight.contiguous(), targets.contiguous(), float(temperature), chunk_size, token_loss
    )
