"""Fused LM head: token logprobs and entropy without materializing [T, V] logits."""

from prime_rl.kernels.lm_head.api import fused_logprobs_entropy, triton_available
from prime_rl.kernels.lm_head.cross_entropy import TokenLoss, fused_nll_sum, fused_token_loss
from prime_rl.kernels.lm_head.math import IGNORE_INDEX
from prime_rl.kernels.lm_head.torch_impl import fused_logprobs_entropy_torch
from prime_rl.kernels.lm_head.vanilla import vanilla_logprobs_entropy

__all__ = [
    "IGNORE_INDEX",
    "TokenLoss",
    "fused_logprobs_entropy",
    "fused_logprobs_entropy_torch",
    "fused_nll_sum",
    "fused_token_loss",
    "triton_available",
    "vanilla_logprobs_entropy",
]
