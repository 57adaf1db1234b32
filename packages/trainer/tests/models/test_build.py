"""build_model API: attention choice validation, meta init, shapes, FLOPs, router stats."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from prime_rl.trainer.models import (
    ATTN_CHOICES,
    build_model,
    load_hf_weights,
    model_flops_per_token,
    num_active_params,
    resolve_attn,
)
from prime_rl.trainer.models.attention import SDPAAttention, VarlenAttention


def test_unknown_attn_lists_choices(hf_model_factory):
    _, path = hf_model_factory("qwen3")
    with pytest.raises(ValueError, match="flash_attention_2.*flash_attention_4"):
        build_model(path, attn="flash")


@pytest.mark.parametrize(
    "attn,package",
    [("flash_attention_2", "pip install flash-attn"), ("flash_attention_4", "pip install flash-attn-4")],
)
def test_missing_flash_attn_names_the_package(attn, package):
    pytest.importorskip("torch")
    try:
        resolve_attn(attn)
    except ImportError as e:
        assert package in str(e)
    else:
        pytest.skip(f"{attn} is installed here")


def test_auto_resolves_without_gpu():
    if torch.cuda.is_available():
        assert resolve_attn("auto") in ATTN_CHOICES
    else:
        assert resolve_attn("auto") == "sdpa"


def test_varlen_on_cpu_errors_unless_auto_fallback():
    q = torch.randn(8, 4, 16)
    k = v = torch.randn(8, 2, 16)
    from prime_rl.trainer.models import PackedSeqs

    seqs = PackedSeqs.from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]))
    with pytest.raises(RuntimeError, match="use attn='sdpa'"):
        VarlenAttention()(q, k, v, seqs)
    torch.testing.assert_close(VarlenAttention(sdpa_fallback=True)(q, k, v, seqs), SDPAAttention()(q, k, v, seqs))


def test_build_api_shapes(hf_model_factory):
    hf_model, path = hf_model_factory("qwen3_moe")
    model = build_model(path, attn="auto", dtype=torch.bfloat16, device="cpu")
    c = model.config
    assert isinstance(model.layers, nn.ModuleList) and len(model.layers) == c.num_hidden_layers
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.bias is None
    assert model.lm_head.weight.shape == (c.vocab_size, c.hidden_size)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    hidden = model(torch.zeros(1, 10, dtype=torch.long), torch.arange(10)[None])
    assert hidden.shape == (1, 10, c.hidden_size)
    # Router stats: every token went to top_k experts.
    stats = model.router_stats()
    assert sorted(stats) == [0, 1]
    assert all(int(s.sum()) == 10 * c.num_experts_per_tok for s in stats.values())


def test_build_from_hf_config_object():
    from transformers import Qwen3Config

    hf_config = Qwen3Config(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16
    )
    model = build_model(hf_config)
    assert model.layers[0].self_attn.q_proj.weight.is_meta
    assert model.layers[0].self_attn.k_proj.weight.shape == (16, 32)


def test_meta_init_is_deterministic_and_keeps_tying(hf_model_factory):
    _, path = hf_model_factory("qwen3_moe", tie_word_embeddings=True)
    states = []
    for _ in range(2):
        model = build_model(path, attn="sdpa", dtype=torch.float32, device="meta")
        model.to_empty(device="cpu")
        torch.manual_seed(123)
        model.init_weights()
        assert model.lm_head.weight is model.embed_tokens.weight
        assert torch.all(model.norm.weight == 1)
        states.append(model.state_dict())
    for name, tensor in states[0].items():
        assert torch.equal(tensor, states[1][name]), name
    std = states[0]["layers.0.mlp.experts.up_proj"].std().item()
    assert abs(std - 0.02) < 0.002


@pytest.mark.parametrize("tied", [False, True])
def test_flops_match_hf_param_count_dense(hf_model_factory, tied):
    hf_model, path = hf_model_factory("qwen3", tie_word_embeddings=tied)
    c = hf_model.config
    n_params = sum(p.numel() for p in hf_model.parameters())  # shared weights counted once
    embedding = c.vocab_size * c.hidden_size
    expected_n = n_params - (0 if tied else embedding)  # LM head counts, embedding lookup does not
    assert num_active_params(build_model(path).config) == expected_n
    seq = 512
    expected = 6 * expected_n + 12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * seq
    assert model_flops_per_token(path, seq) == expected


def test_flops_count_only_active_experts(hf_model_factory):
    hf_model, path = hf_model_factory("qwen3_moe")
    c = hf_model.config
    n_params = sum(p.numel() for p in hf_model.parameters())
    inactive = (
        c.num_hidden_layers * (c.num_experts - c.num_experts_per_tok) * 3 * c.hidden_size * c.moe_intermediate_size
    )
    assert num_active_params(build_model(path).config) == n_params - c.vocab_size * c.hidden_size - inactive


def test_load_then_forward_in_bf16_from_fp32_checkpoint(hf_model_factory):
    hf_model, path = hf_model_factory("qwen3")
    model = build_model(path, attn="sdpa", dtype=torch.bfloat16, device="cpu")
    load_hf_weights(model, path)  # casts fp32 -> bf16
    assert torch.equal(model.embed_tokens.weight, hf_model.model.embed_tokens.weight.to(torch.bfloat16))
