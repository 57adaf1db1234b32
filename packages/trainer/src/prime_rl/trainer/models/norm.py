"""The two RMSNorms of the architectures here; they differ only in where they cast, which bf16 outputs see.

- `RMSNorm` (Llama, Qwen3, GLM-4.5): normalize in fp32, cast back to the input dtype, then scale.
- `NemotronHRMSNorm` (Nemotron-H): normalize and scale in fp32, cast last.

Mamba-2's gated, grouped norm is Mamba's own (`mamba.GatedRMSNorm`).
"""

from __future__ import annotations

import torch
from torch import nn


def _normalized_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32, cast back, then scale: the exact HF order, so bf16 outputs agree.
        return self.weight * _normalized_fp32(x, self.eps).to(x.dtype)


class NemotronHRMSNorm(RMSNorm):
    """RMSNorm that scales in fp32 and casts last (HF NemotronHRMSNorm; Llama's casts before scaling)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight.float() * _normalized_fp32(x, self.eps)).to(x.dtype)
