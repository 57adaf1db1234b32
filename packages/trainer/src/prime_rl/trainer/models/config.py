"""Model architecture config read from a Hugging Face `config.json`.

One flat dataclass covers the supported families (Qwen3, Qwen3-MoE, Llama, GLM-4.5 / GLM-4.5-Air):
they differ only in QK-norm, attention biases, RoPE scaling and partial rotary dimensions, which MLPs are
mixtures of experts, and how the router scores experts (Qwen3-MoE: softmax top-k; GLM-4.5: sigmoid
scores plus a fixed correction bias for the choice, group-limited top-k, scaled weights, shared experts). The raw
`config.json` dict is kept so a saved checkpoint carries the exact config it was loaded with.

Nemotron-H / Nemotron-3 (`nemotron_h`) is a hybrid: each layer is one mixer, chosen by ``layer_types``
(HF `layers_block_type`, or the older `hybrid_override_pattern` string "M*-E": Mamba-2, attention, MLP,
MoE); its Mamba-2 fields are the ``mamba_*`` ones below and its MoE reuses the GLM-4.5 routing fields.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "llama", "glm4_moe", "nemotron_h")
MOE_MODEL_TYPES = ("qwen3_moe", "glm4_moe")
# Nemotron-H's `hybrid_override_pattern` characters -> our layer types.
NEMOTRON_H_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_NEMOTRON_H_BLOCK_TYPES = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass
class ArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool | None = None
    """Bias on the attention output projection; None = same as ``attention_bias`` (Llama, Qwen3).
    GLM-4.5 has q/k/v biases but none on o_proj."""
    qk_norm: bool = True
    partial_rotary_factor: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates (GLM-4.5: 0.5); the rest pass unchanged."""
    initializer_range: float = 0.02
    # MoE fields (num_experts == 0 means dense everywhere)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    first_k_dense_replace: int = 0
    """The first k layers are dense MLPs (GLM-4.5, DeepSeek-V3 style)."""
    router_scoring: str = "softmax"
    """"softmax" (Qwen3-MoE) or "sigmoid" (GLM-4.5: sigmoid scores, top-k chosen on scores plus the
    router's fixed ``e_score_correction_bias``, weights from the unbiased scores)."""
    n_group: int = 1
    topk_group: int = 1
    """Group-limited routing: experts split into ``n_group`` groups, tokens pick among the best ``topk_group``."""
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    """Experts every token goes through (one SwiGLU MLP of n_shared_experts * moe_intermediate_size)."""
    # Nemotron-H fields (layer_types empty means every layer is attention + MLP)
    layer_types: list[str] = field(default_factory=list)
    """Per layer: "mamba", "attention", "mlp" or "moe" (Nemotron-H: one mixer per layer)."""
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    ssm_state_size: int = 0
    mamba_n_groups: int = 1
    """Groups sharing one B / C projection (and one group of the gated RMSNorm) inside Mamba-2."""
    conv_kernel: int = 4
    chunk_size: int = 128
    """Chunk length of the SSD scan (a speed / memory trade-off: the result does not depend on it)."""
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    """dt is clamped to [low, high] (config.json's `time_step_limit`, as vLLM and transformers >= 5.25 do)."""
    use_conv_bias: bool = True
    mamba_proj_bias: bool = False
    """Bias on the Mamba-2 in_proj / out_proj (HF `use_bias`)."""
    moe_shared_expert_intermediate_size: int = 0
    moe_latent_size: int | None = None
    """Routed experts run in this smaller width between fc1/fc2_latent_proj (None: hidden_size)."""
    # The config.json this was parsed from (written back by save_hf_weights).
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)
    # Directory the config came from, if any (tokenizer files are copied from here on save).
    source_dir: str | None = None

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Same rule as HF Qwen3-MoE: sparse every `decoder_sparse_step` layers, except `mlp_only_layers`."""
        if self.layer_types:
            return self.layer_types[layer_idx] == "moe"
        return (
            self.num_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_moe(self) -> bool:
        return any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source_dir: str | None = None) -> ArchConfig:
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type == "nemotron_h":
            return _nemotron_h_config(d, source_dir)
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={d['hidden_act']!r} is not supported; only 'silu' is implemented")
        if d.get("use_sliding_window", False):
            raise ValueError("use_sliding_window=true is not supported; set it to false in config.json")
        if d.get("mlp_bias", False):
            raise ValueError("mlp_bias=true is not supported (no Qwen3/Llama checkpoint uses it)")
        rope_theta, rope_scaling = _parse_rope(d)
        num_heads = d["num_attention_heads"]
        is_moe_type = model_type in MOE_MODEL_TYPES
        is_glm = model_type == "glm4_moe"
        rope_params = d.get("rope_parameters") or {}
        partial_rotary = rope_params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        config = cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            o_proj_bias=False if is_glm else None,
            qk_norm=bool(d.get("use_qk_norm", False)) if is_glm else model_type in ("qwen3", "qwen3_moe"),
            partial_rotary_factor=float(partial_rotary),
            initializer_range=d.get("initializer_range", 0.02),
            # transformers>=5 writes num_local_experts, older versions num_experts.
            num_experts=(d.get("num_experts") or d.get("num_local_experts") or d.get("n_routed_experts") or 0)
            if is_moe_type
            else 0,
            num_experts_per_tok=d.get("num_experts_per_tok", 0) if is_moe_type else 0,
            moe_intermediate_size=d.get("moe_intermediate_size", 0) if is_moe_type else 0,
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            decoder_sparse_step=d.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=list(d.get("mlp_only_layers") or []),
            first_k_dense_replace=d.get("first_k_dense_replace", 0) if is_glm else 0,
            router_scoring="sigmoid" if is_glm else "softmax",
            n_group=d.get("n_group", 1) if is_glm else 1,
            topk_group=d.get("topk_group", 1) if is_glm else 1,
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)) if is_glm else 1.0,
            n_shared_experts=d.get("n_shared_experts", 0) if is_glm else 0,
            hf_config=dict(d),
            source_dir=source_dir,
        )
        check_routing(config)
        return config


def nemotron_h_layer_types(d: dict[str, Any]) -> list[str]:
    """Per-layer mixer types from `layers_block_type` (transformers>=5) or `hybrid_override_pattern`."""
    if d.get("layers_block_type"):
        bad = sorted(set(d["layers_block_type"]) - set(_NEMOTRON_H_BLOCK_TYPES))
        if bad:
            raise ValueError(
                f"layers_block_type has {bad}; each entry must be one of {sorted(_NEMOTRON_H_BLOCK_TYPES)}"
            )
        return [_NEMOTRON_H_BLOCK_TYPES[t] for t in d["layers_block_type"]]
    pattern = d.get("hybrid_override_pattern")
    if not pattern:
        raise ValueError("a nemotron_h config.json needs layers_block_type or hybrid_override_pattern; neither is set")
    bad = sorted(set(pattern) - set(NEMOTRON_H_PATTERN))
    if bad:
        raise ValueError(
            f"hybrid_override_pattern={pattern!r} has {bad}; use only M (Mamba-2), * (attention), - (MLP), E (MoE)"
        )
    return [NEMOTRON_H_PATTERN[ch] for ch in pattern]


def _time_step_limit(d: dict[str, Any]) -> tuple[float, float]:
    """Mamba-2's dt clamp from config.json (`time_step_limit`, or NVIDIA's `mamba_dt_limit`); (0, inf) when absent,
    as in transformers' and vLLM's configs."""
    limit = d.get("mamba_dt_limit", d.get("time_step_limit")) or (0.0, math.inf)
    # transformers writes infinity as {"__float__": "Infinity"} (plain JSON has no inf)
    low, high = (float(x["__float__"] if isinstance(x, dict) else x) for x in limit) if len(limit) == 2 else (1, 0)
    if not low <= high:
        raise ValueError(f"time_step_limit={limit!r} must be [low, high] with low <= high; check config.json")
    return low, high


def _nemotron_h_config(d: dict[str, Any], source_dir: str | None) -> ArchConfig:
    """Nemotron-H / Nemotron-3, reading the old key names HF still accepts (mamba_n_groups, mamba_d_conv, ...)."""
    for key, supported in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if d.get(key, supported) != supported:
            raise ValueError(f"{key}={d[key]!r} is not supported; only {supported!r} is implemented")
    if d.get("mlp_bias", False):
        raise ValueError("mlp_bias=true is not supported (no Nemotron-H checkpoint uses it)")
    if d.get("attention_bias", False):
        raise ValueError("attention_bias=true is not supported: transformers' Nemotron-H ignores it (no bias)")
    layer_types = nemotron_h_layer_types(d)
    num_heads = d["num_attention_heads"]
    has_moe = "moe" in layer_types
    config = ArchConfig(
        model_type="nemotron_h",
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d.get("intermediate_size", 0),
        num_hidden_layers=len(layer_types),
        num_attention_heads=num_heads,
        num_key_value_heads=d.get("num_key_value_heads") or num_heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
        rms_norm_eps=d.get("layer_norm_epsilon", 1e-5),
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        o_proj_bias=False,
        qk_norm=False,
        initializer_range=d.get("initializer_range", 0.02),
        num_experts=(d.get("n_routed_experts") or d.get("num_local_experts") or 0) if has_moe else 0,
        num_experts_per_tok=d.get("num_experts_per_tok", 2) if has_moe else 0,
        moe_intermediate_size=d.get("moe_intermediate_size", 0) if has_moe else 0,
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        router_scoring="sigmoid",
        n_group=d.get("n_group", 1) or 1,
        topk_group=d.get("topk_group", 1) or 1,
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        layer_types=layer_types,
        mamba_num_heads=d.get("mamba_num_heads", 128),
        mamba_head_dim=d.get("mamba_head_dim", 64),
        ssm_state_size=d.get("ssm_state_size", 128),
        mamba_n_groups=d.get("mamba_n_groups", d.get("n_groups", 8)),
        conv_kernel=d.get("mamba_d_conv", d.get("conv_kernel", 4)),
        chunk_size=d.get("mamba_chunk_size", d.get("chunk_size", 128)),
        time_step_limit=_time_step_limit(d),
        use_conv_bias=bool(d.get("mamba_conv_bias", d.get("use_conv_bias", True))),
        mamba_proj_bias=bool(d.get("use_bias", False)),
        moe_shared_expert_intermediate_size=d.get("moe_shared_expert_intermediate_size", 0) if has_moe else 0,
        moe_latent_size=d.get("moe_latent_size") if has_moe else None,
        hf_config=dict(d),
        source_dir=source_dir,
    )
    if config.mamba_num_heads % config.mamba_n_groups:
        raise ValueError(
            f"n_groups={config.mamba_n_groups} must divide mamba_num_heads={config.mamba_num_heads}; check config.json"
        )
    check_routing(config)
    return config


def check_routing(config: ArchConfig) -> None:
    """Group-limited routing needs whole groups of at least two experts (a group scores by its top two)."""
    c = config
    if c.num_experts and c.router_scoring == "sigmoid":
        if c.n_group < 1 or c.num_experts % c.n_group or c.num_experts // c.n_group < 2:
            raise ValueError(
                f"n_group={c.n_group} must divide n_routed_experts={c.num_experts} into groups of >= 2 experts; "
                "check config.json"
            )
        if not 1 <= c.topk_group <= c.n_group:
            raise ValueError(f"topk_group={c.topk_group} must be in 1..n_group={c.n_group}; check config.json")


def _parse_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and scaling from either the transformers>=5 `rope_parameters` or the older keys."""
    params = d.get("rope_parameters")
    if params is not None:
        theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = params if params.get("rope_type", "default") != "default" else None
    else:
        theta = d.get("rope_theta", 10000.0)
        scaling = d.get("rope_scaling")
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type={rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if rope_type == "default":
            scaling = None
    return float(theta), scaling


def load_arch_config(source: Any) -> ArchConfig:
    """Accepts a model dir / config.json path, a dict, a transformers PretrainedConfig or an ArchConfig."""
    if isinstance(source, ArchConfig):
        return source
    if isinstance(source, dict):
        return ArchConfig.from_hf_dict(source)
    if isinstance(source, (str, Path)):
        path = Path(source)
        config_path = path / "config.json" if path.is_dir() else path
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json at {config_path}; pass a Hugging Face model directory")
        return ArchConfig.from_hf_dict(json.loads(config_path.read_text()), source_dir=str(config_path.parent))
    if hasattr(source, "to_dict"):  # transformers.PretrainedConfig, without importing transformers here
        return ArchConfig.from_hf_dict(source.to_dict())
    raise TypeError(
        f"cannot build an ArchConfig from {type(source).__name__}; pass a model dir, a dict or a PretrainedConfig"
    )
