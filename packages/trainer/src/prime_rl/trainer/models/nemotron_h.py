"""Nemotron-H / Nemotron-3 (`NemotronHForCausalLM`): one mixer per layer, chosen by `layer_types`.

Every layer is `x + mixer(norm(x))` with one of: Mamba-2 (`mamba.py`), attention without RoPE (the
Mamba layers carry position), a non-gated relu^2 MLP, or a MoE of relu^2 experts (Nemotron-3) routed
like GLM-4.5 (sigmoid scores, fixed correction bias, group-limited top-k, scaled weights) plus one
shared relu^2 expert and an optional latent projection around the routed experts. Names are HF's
(`layers.{i}.norm`, `layers.{i}.mixer.*`, `mixer.gate`, `mixer.experts.up_proj (E, I, H)`), so the
checkpoint converter only maps the `backbone.` prefix, `embeddings` / `norm_f` and the per-expert
tensors (weights.py). The blocks live in the same `Transformer.layers`, so per-block FSDP, activation
checkpointing, compile and the fused LM head apply unchanged.

Left out: expert parallelism for the relu^2 experts (EP's all-to-all experts are SwiGLU), context
parallelism (the Mamba scan would need the previous rank's state), multi-token-prediction layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prime_rl.trainer.models.config import ArchConfig
from prime_rl.trainer.models.mamba import Mamba2Mixer
from prime_rl.trainer.models.moe import Router, permute_tokens, unpermute_tokens
from prime_rl.trainer.models.norm import NemotronHRMSNorm
from prime_rl.trainer.models.packing import PackedSeqs
from prime_rl.trainer.models.self_attention import Attention

try:  # resolved at import, as in prime_rl.kernels.grouped_gemm
    from prime_rl.kernels.grouped_gemm import triton_grouped_available
    from prime_rl.kernels.grouped_gemm.op import grouped_mm, tile_map
except ImportError:  # no triton: the per-expert loop is the only path
    grouped_mm = tile_map = None


def relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


class ReLU2MLP(nn.Module):
    """down(relu(up(x))^2): Nemotron-H's MLP layer and shared expert (no gate projection)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))


def grouped_relu2(x: torch.Tensor, counts: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """x (M, H) sorted by expert, counts (E,), w_up (E, I, H), w_down (E, H, I) -> (M, H).

    The Triton grouped GEMM on CUDA (bf16 / fp16), a per-expert loop elsewhere; every weight gets a
    gradient (zero for an idle expert) so FSDP sees the same gradients on every rank."""
    if grouped_mm is not None and triton_grouped_available(x):
        ends = torch.cumsum(counts, dim=0, dtype=torch.int32)
        tiles = tile_map(ends, x.shape[0])
        up = grouped_mm(x, w_up.transpose(-2, -1), ends, *tiles)
        return grouped_mm(relu2(up), w_down.transpose(-2, -1), ends, *tiles)
    outputs = [
        relu2(chunk @ w_up[e].t()) @ w_down[e].t()
        for e, chunk in enumerate(torch.split(x, counts.tolist(), dim=0))
        if chunk.numel()
    ]
    if not outputs:
        return x.new_zeros(x.shape[0], w_down.shape[1]) + 0.0 * (w_up.sum() + w_down.sum())
    return torch.cat(outputs, dim=0)


class ReLU2Experts(nn.Module):
    def __init__(self, num_experts: int, dim: int, intermediate_size: int):
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, intermediate_size))

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return grouped_relu2(x, tokens_per_expert, self.up_proj, self.down_proj)


class NemotronHMoE(nn.Module):
    """Routed relu^2 experts (through the latent projection if any) plus the shared expert."""

    def __init__(self, config: ArchConfig):
        super().__init__()
        c = config
        self.num_experts = c.num_experts
        self.gate = Router(c)
        dim = c.moe_latent_size or c.hidden_size
        self.experts = ReLU2Experts(c.num_experts, dim, c.moe_intermediate_size)
        self.shared_experts = ReLU2MLP(c.hidden_size, c.moe_shared_expert_intermediate_size)
        if c.moe_latent_size is not None:
            self.fc1_latent_proj = nn.Linear(c.hidden_size, c.moe_latent_size, bias=False)
            self.fc2_latent_proj = nn.Linear(c.moe_latent_size, c.hidden_size, bias=False)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None
        self.last_tokens_per_expert: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, H) -> (N, H)."""
        topk_weights, topk_idx = self.gate(x)
        routed_in = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        x_sorted, order, tokens_per_expert = permute_tokens(routed_in, topk_idx, self.num_experts)
        y_sorted = self.experts(x_sorted, tokens_per_expert)
        if not torch.compiler.is_compiling():  # see MoE.routed
            self.last_tokens_per_expert = tokens_per_expert.detach()
        y = unpermute_tokens(y_sorted, order, topk_weights, x.shape[0])
        if self.fc2_latent_proj is not None:
            y = self.fc2_latent_proj(y)
        return y + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    """x + mixer(norm(x)); `block_type` is "mamba", "attention", "mlp" or "moe"."""

    def __init__(self, config: ArchConfig, layer_idx: int, attn: str, sdpa_fallback: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.block_type = config.layer_types[layer_idx]
        self.norm = NemotronHRMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.block_type == "mamba":
            self.mixer: nn.Module = Mamba2Mixer(config)
        elif self.block_type == "attention":
            self.mixer = Attention(config, attn, sdpa_fallback)
        elif self.block_type == "mlp":
            self.mixer = ReLU2MLP(config.hidden_size, config.intermediate_size)
        else:
            self.mixer = NemotronHMoE(config)

    @property
    def mlp(self) -> nn.Module | None:
        """The MoE mixer, under the name the MoE-aware passes (compile, EP, router stats) look for."""
        return self.mixer if self.block_type == "moe" else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, seqs: PackedSeqs
    ) -> torch.Tensor:
        """x (T, H) -> (T, H); cos / sin are unused (Nemotron-H attention has no RoPE)."""
        h = self.norm(x)
        if self.block_type == "mamba":
            h = self.mixer(h, seqs)
        elif self.block_type == "attention":
            h = self.mixer(h, None, None, seqs)
        else:
            h = self.mixer(h)
        return x + h
