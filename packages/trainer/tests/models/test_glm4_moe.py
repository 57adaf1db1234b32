"""GLM-4.5 / GLM-4.5-Air (`glm4_moe`): logits and gradients against transformers' Glm4MoeForCausalLM on
tiny random configs, checkpoint round trip, and what the model's config rules refuse."""

from __future__ import annotations

import json

import pytest
import torch

from prime_rl.trainer.models import build_model, load_hf_weights, read_hf_state_dict, save_hf_weights
from prime_rl.trainer.models.config import load_arch_config
from prime_rl.trainer.models.flops import num_active_params

TINY_GLM = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=3,
    n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, partial_rotary_factor=0.5,
    attention_bias=True, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-5,
    max_position_embeddings=256,
)  # fmt: skip
CASES = {
    "air": {},  # GLM-4.5-Air's layout: q/k/v bias, half-rotary heads, first layer dense, grouped sigmoid routing
    "qk_norm_no_norm_topk": {"use_qk_norm": True, "norm_topk_prob": False, "n_shared_experts": 2},
    "full_rotary_no_groups": {"partial_rotary_factor": 1.0, "n_group": 1, "topk_group": 1},
}


def _hf_model(tmp_path, seed=0, **overrides):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(seed)
    config = Glm4MoeConfig(**{**TINY_GLM, **overrides})
    config._attn_implementation = "eager"
    model = Glm4MoeForCausalLM(config).float().eval()
    with torch.no_grad():  # randomize what HF initializes to constants, so a mix-up cannot hide
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)  # large enough to change which experts are chosen
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_gradients_match_transformers(tmp_path, case):
    hf = _hf_model(tmp_path, **CASES[case])
    ours = build_model(tmp_path, attn="sdpa", dtype=torch.float32, device="cpu")
    load_hf_weights(ours, tmp_path)
    ids = torch.randint(0, TINY_GLM["vocab_size"], (1, 48), generator=torch.Generator().manual_seed(2))
    logits = ours.lm_head(ours(ids, torch.arange(48)[None]))
    ref = hf(input_ids=ids).logits
    torch.testing.assert_close(logits, ref, atol=2e-5, rtol=1e-5)

    logits.square().mean().backward()
    ref.square().mean().backward()
    hf_params = dict(hf.named_parameters())
    inter = TINY_GLM["moe_intermediate_size"]
    for name, p in ours.named_parameters():
        if name == "lm_head.weight":
            expected = hf_params["lm_head.weight"].grad
        elif name.endswith("mlp.router.weight"):
            expected = hf_params["model." + name.replace("router", "gate")].grad
        elif ".mlp.experts." in name:  # HF keeps experts fused in memory: gate_up_proj (E, 2I, H)
            prefix, proj = name.rsplit(".", 1)
            if proj == "down_proj":
                expected = hf_params[f"model.{prefix}.down_proj"].grad
            else:
                gate_up = hf_params[f"model.{prefix}.gate_up_proj"].grad
                expected = gate_up[:, :inter] if proj == "gate_proj" else gate_up[:, inter:]
        else:
            expected = hf_params["model." + name].grad
        torch.testing.assert_close(p.grad, expected, atol=1e-5, rtol=1e-4, msg=name)


def test_checkpoint_round_trips_bit_for_bit_without_mtp_layers(tmp_path):
    _hf_model(tmp_path / "hf")
    saved = read_hf_state_dict(tmp_path / "hf")
    # a real GLM-4.5 checkpoint carries its multi-token-prediction layer after the last decoder layer
    mtp = {"model.layers.3.eh_proj.weight": torch.randn(64, 128), "model.layers.3.enorm.weight": torch.ones(64)}
    from safetensors.torch import save_file

    save_file(mtp, str(tmp_path / "hf" / "mtp.safetensors"))
    model = build_model(tmp_path / "hf", attn="sdpa", dtype=torch.float32, device="cpu")
    load_hf_weights(model, tmp_path / "hf")  # the MTP tensors are skipped, not "unexpected"
    save_hf_weights(model, tmp_path / "out")
    again = read_hf_state_dict(tmp_path / "out")
    assert sorted(again) == sorted(saved)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in again
    for name, tensor in saved.items():
        assert torch.equal(again[name], tensor), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "glm4_moe"


def test_config_reads_the_glm_fields_and_counts_active_params(tmp_path):
    hf = _hf_model(tmp_path)
    c = load_arch_config(tmp_path)
    assert (c.num_experts, c.n_group, c.topk_group, c.n_shared_experts, c.first_k_dense_replace) == (8, 4, 2, 1, 1)
    assert c.router_scoring == "sigmoid" and c.routed_scaling_factor == 2.5 and c.rotary_dim == 8
    assert c.attention_bias and c.o_proj_bias is False and not c.qk_norm
    assert [c.is_moe_layer(i) for i in range(3)] == [False, True, True]
    # active params per token: everything but the input embedding, with 3 routed + 1 shared expert per MoE layer
    H, E, inter = 64, 8, 24
    all_params = sum(p.numel() for p in hf.parameters()) - hf.model.embed_tokens.weight.numel()
    inactive = 2 * (E - 3) * 3 * H * inter  # two MoE layers, E - k experts idle
    assert num_active_params(c) == all_params - inactive


@pytest.mark.parametrize(
    "overrides,match",
    [({"n_group": 3}, "n_group=3 must divide"), ({"topk_group": 5}, "topk_group=5 must be in 1..n_group=4")],
)
def test_bad_group_routing_is_refused_with_the_fix(tmp_path, overrides, match):
    d = {**TINY_GLM, **overrides, "model_type": "glm4_moe"}
    with pytest.raises(ValueError, match=match):
        load_arch_config(d)


def test_glm_4_5_air_shape_builds_on_meta_at_its_published_size():
    """GLM-4.5-Air's config.json (zai-org/GLM-4.5-Air): 106B parameters, 12B active."""
    air = dict(
        model_type="glm4_moe", vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_routed_experts=128,
        num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        partial_rotary_factor=0.5, attention_bias=True, routed_scaling_factor=1.0, norm_topk_prob=True,
        use_qk_norm=False, tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=1000000,
        max_position_embeddings=131072, hidden_act="silu", num_nextn_predict_layers=1,
    )  # fmt: skip
    model = build_model(air, device="meta")
    total = sum(p.numel() for p in model.parameters())
    assert 106.5e9 < total < 107.2e9  # 106.85B without the MTP layer
    assert 12.5e9 < num_active_params(load_arch_config(air)) < 13.1e9  # 12.8B with the LM head
