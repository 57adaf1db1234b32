"""The tiny models from prime_rl.common.testing load in transformers and run a forward."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_rl.common.testing import make_tiny_model


@pytest.mark.parametrize(
    "kind,dtype,tie",
    [
        ("qwen3", "bfloat16", False),
        ("qwen3", "float32", True),
        ("qwen3_moe", "bfloat16", True),
        ("qwen3_moe", "float32", False),
    ],
)
def test_transformers_loads_and_runs(tmp_path, kind, dtype, tie):
    path = make_tiny_model(tmp_path / kind, kind=kind, dtype=dtype, tie_word_embeddings=tie, seed=1)
    torch_dtype = getattr(torch, dtype)
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    expected_class = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[kind]
    assert type(model).__name__ == expected_class
    config = json.loads((path / "config.json").read_text())
    assert model.config.head_dim == 64 and model.config.vocab_size == config["vocab_size"]
    assert next(model.parameters()).dtype == torch_dtype

    # Every weight on disk reached the model (no random re-init): compare the embedding exactly.
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
        names = set(f.keys())
    assert ("lm_head.weight" in names) != tie
    torch.testing.assert_close(model.get_input_embeddings().weight.detach(), embed.to(torch_dtype), rtol=0, atol=0)
    if tie:
        assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 plus 30?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nWhat is 12 plus 30?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids[0, 0].item() == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(ids[0]) == prompt
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == model.config.eos_token_id

    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config["vocab_size"])
    assert torch.isfinite(logits).all()


def test_same_seed_same_weights_other_seed_other_weights(tmp_path):
    paths = [make_tiny_model(tmp_path / f"m{i}", seed=s, dtype="float32") for i, s in enumerate((0, 0, 1))]
    tensors = []
    for path in paths:
        with safe_open(str(path / "model.safetensors"), framework="np") as f:
            tensors.append(f.get_tensor("model.layers.0.self_attn.q_proj.weight"))
    np.testing.assert_array_equal(tensors[0], tensors[1])
    assert not np.array_equal(tensors[0], tensors[2])
