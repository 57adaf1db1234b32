"""Tiny random Hugging Face models written with save_pretrained, shared by the model tests.

Until `prime_rl.common.testing.make_tiny_model` lands this builds configs directly with
transformers, which is also the reference implementation the tests compare against.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
TINY_MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)


def make_hf_model(path: Path, kind: str = "qwen3", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """Save a random-weight HF model of `kind` ("qwen3" | "qwen3_moe" | "llama") to `path`; return it (eval)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(seed)
    if kind == "qwen3":
        config, cls = Qwen3Config(**{**TINY, **overrides}), Qwen3ForCausalLM
    elif kind == "qwen3_moe":
        config, cls = Qwen3MoeConfig(**{**TINY, **TINY_MOE, **overrides}), Qwen3MoeForCausalLM
    elif kind == "llama":
        config, cls = LlamaConfig(**{**TINY, **overrides}), LlamaForCausalLM
    else:
        raise ValueError(kind)
    config._attn_implementation = "eager"
    model = cls(config).to(dtype).eval()
    # HF inits norms to ones; randomize them so a swapped norm weight cannot go unnoticed.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


@pytest.fixture
def hf_model_factory(tmp_path: Path) -> Callable:
    counter = iter(range(1000))

    def factory(kind: str = "qwen3", **kwargs):
        path = tmp_path / f"{kind}_{next(counter)}"
        return make_hf_model(path, kind, **kwargs), path

    return factory


def packed_batch(lengths: list[int], vocab_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, sum(lengths)) token ids and positions restarting at 0 per document."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (1, sum(lengths)), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    return input_ids, position_ids


@pytest.fixture
def packed() -> Callable:
    return packed_batch
