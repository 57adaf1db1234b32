"""Our models reproduce transformers' logits: tight in fp32, loose in bf16."""

from __future__ import annotations

import pytest
import torch

from prime_rl.trainer.models import build_model, load_hf_weights

CASES = {
    "qwen3": ("qwen3", {}),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_no_norm_topk": ("qwen3_moe", {"norm_topk_prob": False}),
    "qwen3_moe_mixed_layers": ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
    "llama": ("llama", {}),
    "llama3_rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
}


def _logits(hf_model, path, dtype, input_ids):
    model = build_model(path, attn="sdpa", dtype=dtype, device="cpu")
    load_hf_weights(model, path)
    position_ids = torch.arange(input_ids.shape[1])[None]
    with torch.no_grad():
        ours = model.lm_head(model(input_ids, position_ids))
        ref = hf_model(input_ids=input_ids).logits
    return ours.float(), ref.float()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_fp32(hf_model_factory, case):
    kind, overrides = CASES[case]
    hf_model, path = hf_model_factory(kind, **overrides)
    input_ids = torch.randint(0, hf_model.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(1))
    ours, ref = _logits(hf_model, path, torch.float32, input_ids)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["qwen3", "qwen3_moe"])
def test_logits_match_transformers_bf16(hf_model_factory, case):
    kind, overrides = CASES[case]
    hf_model, path = hf_model_factory(kind, dtype=torch.bfloat16, **overrides)
    input_ids = torch.randint(0, hf_model.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(1))
    ours, ref = _logits(hf_model, path, torch.bfloat16, input_ids)
    # Same op order as HF, so bf16 rounding mostly agrees; a few ulps of the logit scale at most.
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= 5e-2 * scale  # MoE: a near-tie may route differently
    assert (ours - ref).abs().mean().item() <= 3e-3 * scale
