"""Shared math for the fused LM head: checks, the online log-sum-exp merge and the logit gradient.

Notation (per token t): z = hidden @ weight.T / temperature (V logits), p = softmax(z),
lse = logsumexp(z), S = sum_j p_j z_j.

    logprob = z[y] - lse                 entropy = lse - S
    d logprob / dz_j = [j == y] - p_j    d entropy / dz_j = -p_j (z_j - S)

so for upstream grads a (logprob) and b (entropy):

    dL/dz_j = a ([j == y] - p_j) - b p_j (z_j - S)        dL/dlogits = dL/dz / temperature

Both backends keep only lse and S per token (plus the inputs) and recompute z in backward.
"""

import torch

IGNORE_INDEX = -100
"""Conventional ignore target; every negative target is treated the same way."""
DEFAULT_CHUNK_SIZE = 8192
"""Tokens per logits chunk of ``fused_logprobs_entropy`` and its two backends when the caller gives none."""


def check_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float) -> None:
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be 2-D ([T, H] and [V, H]); "
            "flatten batch dimensions first"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: hidden is [T, {hidden.shape[1]}] but weight is [V, {weight.shape[1]}]; "
            "pass the LM-head weight with shape [vocab, hidden]"
        )
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"targets {tuple(targets.shape)} must be [T] = ({hidden.shape[0]},), one id per token")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets dtype {targets.dtype} must be int64 or int32 token ids")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden dtype {hidden.dtype} != weight dtype {weight.dtype}; cast one so they match")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")


def merge_lse_stats(
    m: torch.Tensor, s: torch.Tensor, sz: torch.Tensor, m_new: torch.Tensor, s_new: torch.Tensor, sz_new: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge two partial (max, sum e^(z-max), sum e^(z-max) z) triples over disjoint vocab ranges."""
    m_out = torch.maximum(m, m_new)
    # exp(-inf - finite) = 0, so an empty partial (m = -inf, s = 0) drops out without NaNs.
    a = torch.exp(m - m_out)
    b = torch.exp(m_new - m_out)
    return m_out, s * a + s_new * b, sz * a + sz_new * b


def finalize_stats(
    m: torch.Tensor, s: torch.Tensor, sz: torch.Tensor, z_target: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, s, sz, z[y]) -> (logprobs, entropy, lse, S); ignored targets (< 0) get logprob 0."""
    lse = m + torch.log(s)
    sum_pz = sz / s
    entropy = lse - sum_pz
    logprobs = torch.where(targets >= 0, z_target - lse, torch.zeros_like(lse))
    return logprobs, entropy, lse, sum_pz


def logit_grad(
    z: torch.Tensor,
    lse: torch.Tensor,
    sum_pz: torch.Tensor,
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor,
    local_targets: torch.Tensor,
    inv_temperature: float,
) -> torch.Tensor:
    """dL/dlogits for one [c, v] block of z. local_targets: target column inside the block, or -1."""
    p = torch.exp(z - lse[:, None])  # (c, v)
    dz = p * (-grad_logprobs[:, None] - grad_entropy[:, None] * (z - sum_pz[:, None]))
    rows = torch.nonzero(local_targets >= 0).squeeze(1)
    dz[rows, local_targets[rows]] += grad_logprobs[rows]
    return dz * inv_temperature
