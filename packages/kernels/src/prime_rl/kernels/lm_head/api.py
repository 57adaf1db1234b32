"""`fused_logprobs_entropy`: the one entry point the trainer calls.

Semantics (both backends):
- z = hidden @ weight.T / temperature; logprobs[t] = log_softmax(z[t])[targets[t]];
  entropy[t] = -sum_j p_j log p_j. Both are float32 [T], differentiable w.r.t. hidden and weight.
- Ignored targets: any negative target id (conventionally -100, `IGNORE_INDEX`) gets logprob 0 and
  passes no gradient through its logprob; its entropy is still computed (it does not depend on the
  target). So SFT cross-entropy is `-(logprobs).sum() / (targets >= 0).sum()`. A separate loss mask
  multiplied in by the caller works as well (masked tokens then get zero upstream gradient); it only
  needs valid ids at the masked positions.
- Target ids >= V are an error on the torch path; the Triton path does not check them (it would
  sync the GPU) and returns logprob = -lse for them.
"""

import functools
from typing import Literal

import torch

from prime_rl.kernels.lm_head.math import DEFAULT_CHUNK_SIZE
from prime_rl.kernels.lm_head.torch_impl import fused_logprobs_entropy_torch

Backend = Literal["auto", "triton", "torch"]


@functools.cache
def triton_available() -> bool:
    """True when triton imports and a CUDA device is visible."""
    if not torch.cuda.is_available():
        return False
    try:
        import prime_rl.kernels.lm_head.triton_impl  # noqa: F401
    except ImportError:
        return False
    return True


def fused_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token logprobs and entropy of the LM head without a [T, V] float32 logits tensor.

    hidden [T, H] (bf16/fp32), weight [V, H] (same dtype), targets [T] int64 -> (logprobs [T] fp32,
    entropy [T] fp32). `chunk_size` bounds the tokens per logits block. `backend="auto"` uses Triton
    for CUDA tensors when triton is importable, else the chunked torch implementation.
    """
    if backend == "auto":
        backend = "triton" if hidden.is_cuda and triton_available() else "torch"
    if backend == "triton":
        from prime_rl.kernels.lm_head.triton_impl import fused_logprobs_entropy_triton

        return fused_logprobs_entropy_triton(hidden, weight, targets, temperature, chunk_size)
    if backend == "torch":
        return fused_logprobs_entropy_torch(hidden, weight, targets, temperature, chunk_size)
    raise ValueError(f"backend={backend!r} must be 'auto', 'triton' or 'torch'")
