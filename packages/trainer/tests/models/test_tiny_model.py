"""The shared tiny test models (`prime_rl.common.testing.make_tiny_model`) load, match HF and round-trip."""

from __future__ import annotations

import pytest
import torch

from prime_rl.trainer.models import build_model, load_hf_weights, read_hf_state_dict, save_hf_weights


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_tiny_model_matches_transformers_and_round_trips(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    from prime_rl.common.testing import make_tiny_model

    path = make_tiny_model(tmp_path / kind, kind=kind, dtype="float32")
    model = build_model(path, attn="auto", dtype=torch.float32, device="cpu")
    load_hf_weights(model, path)
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    input_ids = torch.randint(0, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.lm_head(model(input_ids, torch.arange(48)[None]))
        ref = ref_model(input_ids=input_ids).logits
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)

    save_hf_weights(model, tmp_path / "out")
    a, b = read_hf_state_dict(path), read_hf_state_dict(tmp_path / "out")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # Tokenizer files travel with the weights, so the saved dir is a complete model for inference.
    assert (tmp_path / "out" / "tokenizer.json").exists() or not (path / "tokenizer.json").exists()
