"""The RL loss: an importance-ratio policy gradient with token masking on the train/inference gap.

Rollouts are sampled by vLLM with its own logprobs ``q`` (inference) while the trainer recomputes ``p``
(trainer). Even on-policy the two differ (kernels, precision, batch-variance); off-policy steps make
the gap larger. Per loss token t:

    ratio_t = exp(logp_t - logq_t)                       (importance ratio, gradient flows via logp)
    loss_t  = -ratio_t * A_t                             (d loss/d logp = -ratio * A: REINFORCE, IS-corrected)

Tokens whose ratio leaves ``[token_mask_low, token_mask_high]`` are masked out: there the trainer and
inference disagree too much for the sample to be trusted (a mismatch, not a policy improvement), and
their gradient would be dominated by noise. The masked fractions are logged.

``mismatch_kl`` is the k3 estimator of KL(q || p) on loss tokens, ``E_q[r - 1 - log r]`` with
``r = p/q``: >= 0, unbiased, and ~0 when trainer and inference agree.

Normalization: the sum over a micro-batch is divided by ``loss_scale`` (the number of loss tokens in
the whole step over all ranks), so gradient accumulation over micro-batches and data-parallel
averaging give the same gradient as one big batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LossSettings:
    token_mask_low: float = 0.125
    """Mask tokens with importance ratio below this."""
    token_mask_high: float = 8.0
    """Mask tokens with importance ratio above this."""


def rl_loss(
    logprobs: Tensor,  # (T,) fp32, trainer logprobs of the sampled tokens (requires grad)
    inference_logprobs: Tensor,  # (T,) fp32
    advantages: Tensor,  # (T,) fp32
    loss_mask: Tensor,  # (T,) bool
    loss_scale: float,
    settings: LossSettings = LossSettings(),
) -> tuple[Tensor, dict[str, Tensor]]:
    """Return the micro-batch's loss contribution and summed (not averaged) statistics."""
    log_ratio = logprobs - inference_logprobs  # (T,)
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        too_low = loss_mask & (ratio < settings.token_mask_low)
        too_high = loss_mask & (ratio > settings.token_mask_high)
        keep = loss_mask & ~too_low & ~too_high
        lr = log_ratio.detach()
        k3 = torch.exp(lr) - 1.0 - lr  # (T,) KL(q||p) estimator, sampled under q
    per_token = -ratio * advantages  # (T,)
    loss = torch.where(keep, per_token, torch.zeros_like(per_token)).sum() / loss_scale
    stats = {
        "num_loss_tokens": loss_mask.sum().float(),
        "masked_low": too_low.sum().float(),
        "masked_high": too_high.sum().float(),
        "mismatch_kl": torch.where(loss_mask, k3, torch.zeros_like(k3)).sum(),
    }
    return loss, stats
