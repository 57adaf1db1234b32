"""Decoder-only transformer for Qwen3, Qwen3-MoE, Llama, GLM-4.5 (-Air) and the Nemotron-H hybrid, over
packed sequences.

Module names follow Hugging Face (`layers.{i}.self_attn.q_proj`, `input_layernorm`, ...) so weight
conversion is a prefix change plus the MoE router/expert stacking. The forward returns the final
normed hidden states, not logits. What a loss needs comes from the model's own output layer
(`lm_head`, tied to `embed_tokens` when the config says so): `token_outputs`, as `token_logprobs` (per-token
logprobs and entropy, RL) or `token_nll_sum` (SFT's summed NLL), through the fused / chunked head of `lm_head.py`,
so no [T, V] logits tensor is materialized and nothing outside the model reads `lm_head.weight`.

Swappable pieces, by attribute:
- `layers[i].self_attn.core_attention`: the attention kernel over packed documents (CP replaces it).
- `layers[i].mlp`: `MLP` or `MoE`; `mlp.experts` is the expert computation (grouped GEMM / EP).
- Nemotron-H (`nemotron_h.py`): `layers[i]` is a `NemotronHBlock` with one `mixer` (Mamba-2, attention,
  MLP or MoE); its `mlp` is the MoE mixer or None.

Left out: KV cache and generation (inference is vLLM), dropout, sliding-window attention.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from prime_rl.kernels import TokenLoss
from prime_rl.trainer.models.attention import prepare_masks
from prime_rl.trainer.models.config import ArchConfig
from prime_rl.trainer.models.lm_head import lm_head_logprobs_entropy, lm_head_nll_sum, lm_head_token_loss
from prime_rl.trainer.models.mamba import GatedRMSNorm, Mamba2Mixer
from prime_rl.trainer.models.mlp import MLP
from prime_rl.trainer.models.moe import MoE
from prime_rl.trainer.models.nemotron_h import NemotronHBlock, NemotronHMoE
from prime_rl.trainer.models.norm import NemotronHRMSNorm, RMSNorm
from prime_rl.trainer.models.packing import PackedSeqs
from prime_rl.trainer.models.rope import RotaryEmbedding
from prime_rl.trainer.models.self_attention import Attention


class TransformerBlock(nn.Module):
    def __init__(self, config: ArchConfig, layer_idx: int, attn: str, sdpa_fallback: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, attn, sdpa_fallback)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe_layer(layer_idx):
            self.mlp: nn.Module = MoE(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqs: PackedSeqs) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, seqs)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: ArchConfig, attn: str, sdpa_fallback: bool = False):
        super().__init__()
        self.config = config
        self.attn = attn
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        hybrid = config.model_type == "nemotron_h"
        block = NemotronHBlock if hybrid else TransformerBlock
        self.layers = nn.ModuleList(block(config, i, attn, sdpa_fallback) for i in range(config.num_hidden_layers))
        self.norm = (NemotronHRMSNorm if hybrid else RMSNorm)(config.hidden_size, config.rms_norm_eps)
        self.rotary = None if hybrid else RotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (call again after to_empty)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, seqs: PackedSeqs | None = None
    ) -> torch.Tensor:
        """input_ids, position_ids (B, T) -> final-normed hidden states (B, T, H).

        Rows are concatenated into one packed sequence; documents start where position_ids == 0 and
        at each row start, and attention never crosses a document boundary. ``seqs``: those boundaries
        built on the host from the same position_ids (see ``PackedSeqs``); without it they are derived
        here, at the cost of one device-to-host sync.
        """
        if input_ids.shape != position_ids.shape or input_ids.dim() != 2:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and position_ids {tuple(position_ids.shape)} "
                "must both be (B, T); pass packed rows as (1, T)"
            )
        batch, seq_len = input_ids.shape
        if seqs is None:
            seqs = PackedSeqs.from_position_ids(position_ids)
        prepare_masks(seqs, self.attn)
        x = self.embed_tokens(input_ids.reshape(-1))  # (T, H)
        cos, sin = self.rotary(seqs.position_ids, x.dtype) if self.rotary is not None else (None, None)
        for layer in self.layers:
            x = layer(x, cos, sin, seqs)
        return self.norm(x).view(batch, seq_len, -1)

    def token_outputs(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        targets: torch.Tensor,
        temperature: float = 1.0,
        seqs: PackedSeqs | None = None,
        chunk_size: int | None = None,
        nll_sum: bool = False,
        token_loss: TokenLoss | None = None,
    ) -> tuple[torch.Tensor, ...] | torch.Tensor:
        """(1, T) ids, positions, targets -> what a loss reads of the distribution at ``temperature``; targets < 0
        are ignored. ``chunk_size``: tokens per fused LM-head chunk (None: the full [T, V] logits). ``seqs`` as in
        ``forward``.

        - ``nll_sum=False`` (``token_logprobs``, RL): (logprobs, entropy), each (T,) fp32; ignored targets give
          logprob 0.
        - ``nll_sum=True`` (``token_nll_sum``, SFT): one fp32 scalar, -sum of the non-ignored targets' logprobs,
          through the cross-entropy-only head: no entropy, and fused (``chunk_size`` set) three LM-head matmuls
          instead of four, because the gradient is computed in the forward.
        - ``token_loss`` (RL's token-level loss, ``prime_rl.kernels.TokenLoss``): (loss, logprobs, entropy), the
          loss from ``token_loss`` of the logprobs, which with entropy come without gradient; fused, the loss's
          gradient is computed in the forward as for ``nll_sum``."""
        hidden = self(input_ids, position_ids, seqs=seqs).flatten(0, 1)  # (T, H); self(): forward hooks run (CP)
        if token_loss is not None:
            return lm_head_token_loss(
                hidden, self.lm_head.weight, targets.flatten(), temperature, chunk_size, token_loss
            )
        head = lm_head_nll_sum if nll_sum else lm_head_logprobs_entropy
        return head(hidden, self.lm_head.weight, targets.flatten(), temperature, chunk_size)

    token_logprobs = functools.partialmethod(token_outputs, nll_sum=False)
    """``token_outputs`` for RL: (logprobs, entropy)."""
    token_nll_sum = functools.partialmethod(token_outputs, nll_sum=True)
    """``token_outputs`` for SFT: the summed NLL."""

    @torch.no_grad()
    def init_weights(self) -> None:
        """Fill every parameter (e.g. after `to_empty()` from meta) as HF does: N(0, initializer_range)
        for matrices, zeros for biases, ones for norms. Deterministic given the torch seed."""
        self.tie_weights()
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (RMSNorm, NemotronHRMSNorm, GatedRMSNorm)):
                nn.init.ones_(module.weight)
            elif isinstance(module, Mamba2Mixer):
                module.init_weights()  # conv1d, A_log, D, dt_bias; its Linears and norm come next
            elif isinstance(module, nn.Linear):
                if module is self.lm_head and self.config.tie_word_embeddings:
                    continue
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, MoE):
                nn.init.normal_(module.router.weight, mean=0.0, std=std)
                if hasattr(module.router, "e_score_correction_bias"):  # a buffer: to_empty() left garbage
                    module.router.e_score_correction_bias.zero_()
                for weight in (module.experts.gate_proj, module.experts.up_proj, module.experts.down_proj):
                    nn.init.normal_(weight, mean=0.0, std=std)
            elif isinstance(module, NemotronHMoE):
                nn.init.normal_(module.gate.weight, mean=0.0, std=std)
                module.gate.e_score_correction_bias.zero_()
                for weight in (module.experts.up_proj, module.experts.down_proj):
                    nn.init.normal_(weight, mean=0.0, std=std)

    def router_stats(self) -> dict[int, torch.Tensor]:
        """Tokens routed to each expert in the last forward, per MoE layer index (not recorded by compiled
        blocks)."""
        return {
            layer.layer_idx: layer.mlp.last_tokens_per_expert
            for layer in self.layers
            if isinstance(layer.mlp, (MoE, NemotronHMoE)) and layer.mlp.last_tokens_per_expert is not None
        }
