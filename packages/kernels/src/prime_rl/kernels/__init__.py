"""prime_rl.kernels: fused / chunked kernels (Triton on GPU, plain-torch reference everywhere)."""

from prime_rl.kernels.lm_head import (
    IGNORE_INDEX,
    fused_logprobs_entropy,
    fused_logprobs_entropy_torch,
    fused_nll_sum,
    triton_available,
    vanilla_logprobs_entropy,
)

__all__ = [
    "IGNORE_INDEX",
    "fused_logprobs_entropy",
    "fused_logprobs_entropy_torch",
    "fused_nll_sum",
    "triton_available",
    "vanilla_logprobs_entropy",
]
