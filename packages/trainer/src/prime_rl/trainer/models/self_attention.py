"""The attention layer (HF's `self_attn`): Q/K/V projections, optional QK norm, optional RoPE, the core
attention kernel over packed documents (`attention.py`), the output projection.

Its own module because two block types use it: `transformer.TransformerBlock` (with RoPE) and
`nemotron_h.NemotronHBlock` (without: the Mamba layers carry position), and `transformer.py` builds both.
"""

from __future__ import annotations

import torch
from torch import nn

from prime_rl.trainer.models.attention import build_core_attention
from prime_rl.trainer.models.config import ArchConfig
from prime_rl.trainer.models.norm import RMSNorm
from prime_rl.trainer.models.packing import PackedSeqs
from prime_rl.trainer.models.rope import apply_rotary


class Attention(nn.Module):
    def __init__(self, config: ArchConfig, attn: str, sdpa_fallback: bool):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        o_bias = bias if config.o_proj_bias is None else config.o_proj_bias
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.core_attention = build_core_attention(attn, sdpa_fallback)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, seqs: PackedSeqs
    ) -> torch.Tensor:
        """x (T, H) -> (T, H); cos / sin None: no RoPE (Nemotron-H)."""
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)  # (T, Hq, D)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core_attention(q, k, v, seqs)  # (T, Hq, D)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
