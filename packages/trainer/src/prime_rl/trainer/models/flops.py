"""Parameter and FLOP counts for MFU (torchtitan's formula, the same as benchmarks' HF anchor).

FLOPs per token = 6 * N + 12 * layers * heads * head_dim * seq_len, where N counts the parameters a
token actually multiplies: every weight except the input embedding (a lookup, not a matmul), the LM
head always (even when tied), and for MoE layers the router plus only the `num_experts_per_tok` active
experts.

Nemotron-H counts each layer's own mixer (Mamba-2, attention, MLP or MoE) and the attention term only
for its attention layers; the SSD scan's own FLOPs (its chunk-local attention-like products, about
4 * chunk_size * mamba_heads * (state + head_dim) per token and Mamba layer, forward) are left out like
every non-weight FLOP but attention's.
"""

from __future__ import annotations

from typing import Any

from prime_rl.trainer.models.config import ArchConfig, load_arch_config


def num_active_params(config: ArchConfig) -> int:
    """Parameters touched per token, excluding the input embedding."""
    c = config
    if c.model_type == "nemotron_h":
        return _nemotron_h_active_params(c)
    hidden, q_dim, kv_dim = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attn = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    if c.attention_bias:
        attn += q_dim + 2 * kv_dim
    if c.attention_bias if c.o_proj_bias is None else c.o_proj_bias:
        attn += hidden
    if c.qk_norm:
        attn += 2 * c.head_dim
    total = 0
    for layer in range(c.num_hidden_layers):
        if c.is_moe_layer(layer):
            active = c.num_experts_per_tok + c.n_shared_experts  # shared experts: n x moe_intermediate wide
            mlp = hidden * c.num_experts + active * 3 * hidden * c.moe_intermediate_size
        else:
            mlp = 3 * hidden * c.intermediate_size
        total += attn + mlp + 2 * hidden  # + the two RMSNorms
    return total + hidden + c.vocab_size * hidden  # final norm + LM head


def _nemotron_h_active_params(c: ArchConfig) -> int:
    hidden, q_dim, kv_dim = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    inner, heads, bc = c.mamba_num_heads * c.mamba_head_dim, c.mamba_num_heads, 2 * c.mamba_n_groups * c.ssm_state_size
    conv_dim = inner + bc
    per_type = {
        "mamba": hidden * (2 * inner + bc + heads) + conv_dim * c.conv_kernel + 3 * heads + inner + inner * hidden
        + c.use_conv_bias * conv_dim + c.mamba_proj_bias * (2 * inner + bc + heads + hidden),
        "attention": 2 * hidden * q_dim + 2 * hidden * kv_dim,
        "mlp": 2 * hidden * c.intermediate_size,
        "moe": hidden * c.num_experts  # router
        + c.num_experts_per_tok * 2 * (c.moe_latent_size or hidden) * c.moe_intermediate_size
        + 2 * hidden * c.moe_shared_expert_intermediate_size
        + (2 * hidden * c.moe_latent_size if c.moe_latent_size else 0),
    }  # fmt: skip
    layers = sum(per_type[t] + hidden for t in c.layer_types)  # + the block's norm
    return layers + hidden + c.vocab_size * hidden  # final norm + LM head


def model_flops_per_token(config: Any, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at sequence length `seq_len`."""
    c = load_arch_config(config)
    attention_layers = c.layer_types.count("attention") if c.layer_types else c.num_hidden_layers
    attention = 12 * attention_layers * c.num_attention_heads * c.head_dim * seq_len
    return float(6 * num_active_params(c) + attention)
