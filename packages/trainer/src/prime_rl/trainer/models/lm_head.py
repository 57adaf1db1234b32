"""The output layer in the two forms the losses need, never as a [T, V] logits tensor unless asked to.

- `lm_head_logprobs_entropy`: each target's logprob and the entropy of the tempered distribution (RL);
- `lm_head_nll_sum`: -sum of the target logprobs, the cross-entropy-only head (SFT);
- `lm_head_token_loss`: a caller's per-token loss of the logprobs, with the logprobs and entropy (RL's
  token-level ratio loss): fused, its gradient is formed in the forward, three matmuls instead of four.

Chunk by chunk through `prime_rl.kernels` (Triton on CUDA, its plain-torch reference elsewhere) when
`chunk_size` is set; None materializes the full logits (`vanilla_logprobs_entropy`), the reference the fused head is
checked against. The kernels read the weight matrix itself, not the `nn.Linear`: so the LM head cannot carry
a LoRA adapter (`prime_rl.trainer.lora` refuses one; `modules_to_save` trains it in full), and whatever
the weight is at call time is what gets multiplied: under FSDP2 the root unit's gathered bf16 weight,
whose gradient flows back into FSDP's reduce-scatter; with tied embeddings the embedding matrix itself.

Only the model calls these (`Transformer.token_outputs`): it owns the weight.
"""

from __future__ import annotations

import torch

from prime_rl.kernels import (
    TokenLoss,
    fused_logprobs_entropy,
    fused_nll_sum,
    fused_token_loss,
    vanilla_logprobs_entropy,
)


def lm_head_logprobs_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float, chunk_size: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (T, H), weight (V, H), targets (T,) -> (logprobs, entropy), each (T,) fp32; targets < 0 give 0."""
    if chunk_size is None:
        return vanilla_logprobs_entropy(hidden, weight, targets, temperature)
    return fused_logprobs_entropy(hidden, weight, targets, temperature=temperature, chunk_size=chunk_size)


def lm_head_nll_sum(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float, chunk_size: int | None
) -> torch.Tensor:
    """hidden (T, H), weight (V, H), targets (T,) -> one fp32 scalar, -sum of the non-ignored targets' logprobs.
    Fused, the gradient is computed in the forward: three LM-head matmuls instead of four, and no entropy."""
    if chunk_size is None:
        return -vanilla_logprobs_entropy(hidden, weight, targets, temperature)[0].sum()
    # its chunk is sized by the kernel from the vocabulary and the memory it may use, not `chunk_size`
    return fused_nll_sum(hidden, weight, targets, temperature=temperature)


def lm_head_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int | None,
    token_loss: TokenLoss,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (loss, logprobs, entropy): loss = ``token_loss`` over the tokens' logprobs (fp32 scalar with gradient);
    logprobs and entropy (T,) fp32 without. Fused, ``token_loss`` runs once per chunk of the kernel's size."""
    if chunk_size is None:
        logprobs, entropy = vanilla_logprobs_entropy(hidden, weight, targets, temperature)
        return token_loss(logprobs, 0, logprobs.shape[0]), logprobs.detach(), entropy.detach()
    return fused_token_loss(hidden, weight, targets, token_loss, temperature=temperature)
