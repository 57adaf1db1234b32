"""Rotary position embedding, computed from position_ids on every forward.

No buffer holds the frequencies: a model built on the meta device and materialized with
`to_empty()` would otherwise carry garbage there unless someone remembered to re-init it, and
FSDP would have to shard or skip it. The inverse frequencies are computed on CPU in fp32 exactly as
Hugging Face does (so logits match bit for bit in fp32) and cached per device.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from prime_rl.trainer.models.config import ArchConfig


def compute_inv_freq(config: ArchConfig) -> torch.Tensor:
    """(rotary_dim / 2,) fp32 on CPU; 'default' or Llama 3.1's 'llama3' frequency scaling. rotary_dim is
    head_dim unless the model rotates only part of each head (GLM-4.5's partial_rotary_factor)."""
    dim = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # llama3: low frequencies are divided by `factor`, high ones kept, the band between interpolated.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ArchConfig):
        super().__init__()
        self.config = config
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids (T,) -> cos, sin (T, rotary_dim) in `dtype`."""
        device = position_ids.device
        if device not in self._inv_freq:
            self._inv_freq[device] = compute_inv_freq(self.config).to(device)
        with torch.autocast(device_type=device.type, enabled=False):
            freqs = position_ids.float()[:, None] * self._inv_freq[device][None, :]  # (T, D/2)
            emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
            return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D), cos/sin (T, R) with R <= D: the first R dimensions rotate, the rest pass (as HF)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)
