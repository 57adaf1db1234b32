"""The vanilla LM head (materializes [T, V] float32 logits): what the fused kernel replaces.

Kept for the benchmark, for `fused_lm_head_token_chunk_size = "disabled"` and as a test reference
(with float64 inputs it is the exact answer). Same semantics as the fused path: negative targets
give logprob 0 and no gradient through it.
"""

import torch


def vanilla_logprobs_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = (hidden @ weight.T).float() if hidden.dtype != torch.float64 else hidden @ weight.T  # (T, V)
    logp = torch.log_softmax(logits / temperature, dim=-1)  # (T, V)
    valid = targets >= 0
    target_logp = logp.gather(-1, targets.clamp(min=0)[:, None]).squeeze(-1)
    logprobs = torch.where(valid, target_logp, torch.zeros_like(target_logp))
    entropy = -(logp.exp() * logp).sum(-1)
    return logprobs, entropy
