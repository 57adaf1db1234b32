"""`build_model`: config -> Transformer on the requested device and dtype."""

from __future__ import annotations

from typing import Any

import torch

from prime_rl.trainer.models.attention import resolve_attn
from prime_rl.trainer.models.config import load_arch_config
from prime_rl.trainer.models.transformer import Transformer


def build_model(
    model_dir_or_hf_config: Any,
    attn: str = "auto",
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "meta",
) -> Transformer:
    """Build the model for a HF model dir (reads config.json), config dict, PretrainedConfig or ArchConfig.

    The module is always constructed on meta (no wasted default init). For device "meta" it stays
    there: the caller shards it, then `to_empty()` + `init_weights()` or `load_hf_weights`. For a real
    device it is materialized and filled by `init_weights()` (call `load_hf_weights` to load a checkpoint).
    """
    config = load_arch_config(model_dir_or_hf_config)
    resolved = resolve_attn(attn)
    with torch.device("meta"):
        model = Transformer(config, attn=resolved, sdpa_fallback=attn == "auto")
    model.to(dtype=dtype)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        model.init_weights()
    return model
