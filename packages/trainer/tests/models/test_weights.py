"""HF safetensors <-> model: bit-exact round trip, sharding, converters, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from prime_rl.trainer.models import (
    build_model,
    hf_state_dict_to_model,
    load_hf_weights,
    model_state_dict_to_hf,
    read_hf_state_dict,
    save_hf_weights,
)


def _assert_same_checkpoint(a, b):
    sd_a, sd_b = read_hf_state_dict(a), read_hf_state_dict(b)
    assert sorted(sd_a) == sorted(sd_b)
    for name in sd_a:
        assert sd_a[name].dtype == sd_b[name].dtype, name
        assert torch.equal(sd_a[name].view(torch.uint8), sd_b[name].view(torch.uint8)), name


@pytest.mark.parametrize(
    "kind,dtype,overrides",
    [
        ("qwen3", torch.float32, {}),
        ("qwen3", torch.bfloat16, {"tie_word_embeddings": True}),
        ("qwen3_moe", torch.bfloat16, {}),
        ("qwen3_moe", torch.float32, {"num_hidden_layers": 3, "mlp_only_layers": [0]}),
        ("llama", torch.bfloat16, {}),
    ],
)
def test_load_save_round_trip_is_bit_exact(hf_model_factory, tmp_path, kind, dtype, overrides):
    _, src = hf_model_factory(kind, dtype=dtype, **overrides)
    model = build_model(src, attn="sdpa", dtype=dtype, device="cpu")
    load_hf_weights(model, src)
    out = tmp_path / "saved"
    save_hf_weights(model, out)
    _assert_same_checkpoint(src, out)
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    # The same through a plain state dict (what the training loop hands over after gathering).
    out2 = tmp_path / "saved_sd"
    save_hf_weights(model.state_dict(), out2, model.config)
    _assert_same_checkpoint(src, out2)


def test_sharded_save_and_load(hf_model_factory, tmp_path):
    _, src = hf_model_factory("qwen3_moe")
    model = build_model(src, attn="sdpa", dtype=torch.float32, device="cpu")
    load_hf_weights(model, src)
    out = tmp_path / "sharded"
    save_hf_weights(model, out, max_shard_bytes=64 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and not (out / "model.safetensors").exists()
    for f in files:
        with safe_open(str(out / f), framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}
    reloaded = build_model(out, attn="sdpa", dtype=torch.float32, device="cpu")
    load_hf_weights(reloaded, out)
    for (name, a), b in zip(model.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name
    # Saving unsharded into the same dir replaces the shards instead of leaving both around.
    save_hf_weights(model, out)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()


def test_converters_stack_experts_and_invert(hf_model_factory):
    hf_model, src = hf_model_factory("qwen3_moe")
    config = build_model(src, attn="sdpa", device="meta").config
    hf_sd = read_hf_state_dict(src)
    sd = hf_state_dict_to_model(hf_sd, config)
    gate = sd["layers.1.mlp.experts.gate_proj"]
    assert gate.shape == (4, config.moe_intermediate_size, config.hidden_size)
    assert torch.equal(gate[2], hf_sd["model.layers.1.mlp.experts.2.gate_proj.weight"])
    assert torch.equal(sd["layers.0.mlp.router.weight"], hf_sd["model.layers.0.mlp.gate.weight"])
    back = model_state_dict_to_hf(sd, config)
    assert sorted(back) == sorted(hf_sd)
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)


def test_tied_embeddings_share_one_tensor(hf_model_factory, tmp_path):
    _, src = hf_model_factory("qwen3", tie_word_embeddings=True)
    model = build_model(src, attn="sdpa", dtype=torch.float32, device="cpu")
    load_hf_weights(model, src)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert "lm_head.weight" not in read_hf_state_dict(src)
    save_hf_weights(model, tmp_path / "out")
    assert "lm_head.weight" not in read_hf_state_dict(tmp_path / "out")


def test_untied_embeddings_are_separate(hf_model_factory):
    _, src = hf_model_factory("qwen3", tie_word_embeddings=False)
    model = build_model(src, attn="sdpa", dtype=torch.float32, device="cpu")
    load_hf_weights(model, src)
    assert model.lm_head.weight is not model.embed_tokens.weight
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)
    assert torch.equal(model.lm_head.weight, read_hf_state_dict(src)["lm_head.weight"])


def test_side_files_copied(hf_model_factory, tmp_path):
    _, src = hf_model_factory("qwen3")
    (src / "tokenizer.json").write_text('{"fake": true}')
    model = build_model(src, attn="sdpa", dtype=torch.float32, device="cpu")
    save_hf_weights(model, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"fake": true}'


def test_load_rejects_mismatched_checkpoint(hf_model_factory):
    _, two_layers = hf_model_factory("qwen3")
    _, three_layers = hf_model_factory("qwen3", num_hidden_layers=3)
    model = build_model(two_layers, attn="sdpa", dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"missing \[\] \(0\), unexpected \['layers.2"):
        load_hf_weights(model, three_layers)


def test_load_rejects_moe_checkpoint_into_dense_model(hf_model_factory):
    _, dense = hf_model_factory("qwen3")
    _, moe = hf_model_factory("qwen3_moe")
    model = build_model(dense, attn="sdpa", dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="4 experts .* this layer dense"):
        load_hf_weights(model, moe)


def test_load_into_meta_model_says_to_materialize(hf_model_factory):
    _, src = hf_model_factory("qwen3")
    model = build_model(src, attn="sdpa", device="meta")
    with pytest.raises(RuntimeError, match="to_empty"):
        load_hf_weights(model, src)
