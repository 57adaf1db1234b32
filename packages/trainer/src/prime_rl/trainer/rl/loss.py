"""The RL loss: an importance-ratio policy gradient with masking on the train/inference gap.

Rollouts are sampled by vLLM with its own logprobs ``q`` (inference) while the trainer recomputes ``p``
(trainer). Even on-policy the two differ (kernels, precision, batch-variance); off-policy steps make
the gap larger. Two ratios (``LossSettings.ratio``):

- ``"token"`` (default): per loss token t, ``r_t = exp(logp_t - logq_t)`` and ``loss_t = -r_t * A_t``
  (d loss / d logp = -r * A: REINFORCE, importance-corrected). Tokens whose ratio leaves
  ``[mask_low, mask_high]`` are masked out: there trainer and inference disagree too much for the token
  to be trusted, and its gradient would be dominated by noise.
- ``"sequence"`` (GSPO): per sample i, the geometric mean of its tokens' ratios,
  ``s_i = exp(mean_{t in i} (logp_t - logq_t))``, and ``loss_t = -s_i * A_t`` for each of its tokens;
  a whole sample is masked when ``s_i`` leaves ``[mask_low, mask_high]``.

Normalization is a per-token weight ``w_t`` and a divisor ``loss_scale``, set by the caller from the
step's global counts (so micro-batches and data-parallel ranks give one big batch's gradient):
``token`` = sum / global loss tokens; ``sequence`` = mean over samples of each sample's token mean
(``w_t = 1 / n_i``, divisor = global samples); ``constant`` (Dr. GRPO) = sum / (global samples x a
fixed max length). With the sequence ratio and ``sequence`` normalization the loss is exactly GSPO's
``-mean_i s_i A_i``.

KL control (``kl_coef > 0``): ``+ kl_coef * kl_t`` per loss token against a reference policy's logprobs
``logref`` (the trainer's frozen copy of the initial weights), with Schulman's estimators of
KL(p || ref) on samples of p: k1 = ``logp - logref``, k3 = ``exp(logref - logp) - (logref - logp) - 1``
(>= 0, lower variance). Gradients flow through ``logp`` only.

``mismatch_kl`` is the k3 estimator of KL(q || p) on loss tokens, ``E_q[r - 1 - log r]`` with
``r = p/q``: >= 0, unbiased, and ~0 when trainer and inference agree.

Context parallelism: each cp rank holds a contiguous slice of the forward, and a sample may straddle the
slice boundary. Everything per token is local. The sequence ratio needs the sample's whole mean: the
per-sample sums of the log-ratio and of the loss tokens are all-reduced over ``cp_group`` with an
autograd all-reduce (its backward all-reduces the gradient, so a token's logprob receives the gradient of
the sample's tokens on every slice). ``sample_ids`` index samples of the whole forward (the same ids on
every cp rank) and ``num_segments`` sizes the per-sample arrays identically on every cp rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class LossSettings:
    ratio: Literal["token", "sequence"] = "token"
    """Importance ratio per token, or per sample (geometric mean of its tokens' ratios, GSPO)."""
    mask_low: float = 0.125
    """Mask tokens (token ratio) or whole samples (sequence ratio) whose ratio is below this."""
    mask_high: float = 8.0
    """... or above this."""
    kl_coef: float = 0.0
    """Weight of the KL term against the reference policy; 0 = no KL term (no reference needed)."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """Estimator of KL(policy || reference) per token."""


def segment_sum(values: Tensor, sample_ids: Tensor, size: int | None = None) -> Tensor:
    """(T,) values, (T,) sample index -> (size,) per-sample sums (index = sample; default size T: no host sync)."""
    return values.new_zeros(values.shape[0] if size is None else size).index_add(0, sample_ids, values)


def kl_to_reference(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """(T,) per-token estimate of KL(policy || reference) on policy samples; differentiable in logprobs."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    log_ratio = ref_logprobs - logprobs  # log(ref / p)
    return torch.exp(log_ratio) - log_ratio - 1.0


def rl_loss(
    logprobs: Tensor,  # (T,) fp32, trainer logprobs of the sampled tokens (requires grad)
    inference_logprobs: Tensor,  # (T,) fp32
    advantages: Tensor,  # (T,) fp32
    loss_mask: Tensor,  # (T,) bool
    loss_scale: float | Tensor,
    settings: LossSettings = LossSettings(),
    *,
    weights: Tensor | None = None,  # (T,) per-token normalization weight; None = 1
    sample_ids: Tensor | None = None,  # (T,) int64 sample index of each position (sequence ratio)
    ref_logprobs: Tensor | None = None,  # (T,) fp32 reference logprobs (KL term)
    num_segments: int | None = None,  # size of the per-sample arrays (> every sample id); None = T
    cp_group: dist.ProcessGroup | None = None,  # context parallelism: sum per-sample quantities over it
) -> tuple[Tensor, dict[str, Tensor]]:
    """Return the micro-batch's loss contribution ``sum_t keep_t w_t loss_t / loss_scale`` and summed stats."""
    log_ratio = logprobs - inference_logprobs  # (T,)
    if settings.ratio == "sequence":
        if sample_ids is None:
            raise ValueError("the sequence-level ratio needs sample_ids (the sample index of every position)")
        masked_log_ratio = torch.where(loss_mask, log_ratio, torch.zeros_like(log_ratio))
        size = log_ratio.shape[0] if num_segments is None else num_segments
        sums = segment_sum(masked_log_ratio, sample_ids, size)  # (S,) log-ratio sum per sample
        n = segment_sum(loss_mask.to(log_ratio.dtype), sample_ids, size)  # (S,) loss tokens per sample
        if cp_group is not None:  # whole samples across the slices; autograd: gradients are all-reduced back
            from torch.distributed.nn.functional import all_reduce

            sums, n = all_reduce(torch.cat([sums, n]), group=cp_group).split(size)
        seq_log_ratio = sums / n.clamp(min=1.0)
        ratio = torch.exp(seq_log_ratio[sample_ids])  # (T,) s_i of each token's sample
    else:
        ratio = torch.exp(log_ratio)
    with torch.no_grad():
        too_low = loss_mask & (ratio < settings.mask_low)
        too_high = loss_mask & (ratio > settings.mask_high)
        keep = loss_mask & ~too_low & ~too_high
        lr = log_ratio.detach()
        k3 = torch.exp(lr) - 1.0 - lr  # (T,) KL(q||p) estimator, sampled under q
    per_token = -ratio * advantages  # (T,)
    stats = {
        "num_loss_tokens": loss_mask.sum().float(),
        "masked_low": too_low.sum().float(),
        "masked_high": too_high.sum().float(),
        "mismatch_kl": torch.where(loss_mask, k3, torch.zeros_like(k3)).sum(),
    }
    per_token = torch.where(keep, per_token, torch.zeros_like(per_token))
    if settings.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs (the reference policy's logprobs)")
        kl = torch.where(loss_mask, kl_to_reference(logprobs, ref_logprobs, settings.kl_estimator), 0.0)
        per_token = per_token + settings.kl_coef * kl
        stats["kl_ref"] = kl.detach().sum()
    if weights is not None:
        per_token = per_token * weights
    return per_token.sum() / loss_scale, stats
