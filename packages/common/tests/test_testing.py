"""make_tiny_model without torch: the files, the tokenizer, and the exact weight names / dtypes on disk."""

import json
import struct

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from tokenizers import Tokenizer  # noqa: E402

from prime_rl.common.testing import (  # noqa: E402
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    bf16_bits_to_float32,
    make_tiny_model,
    write_safetensors,
)


def _header(path) -> dict:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__")
    return header


def test_dense_model_files_and_parameter_names(tmp_path):
    path = make_tiny_model(tmp_path / "m", kind="qwen3", num_layers=2)
    assert {p.name for p in path.iterdir()} >= {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 64
    assert config["torch_dtype"] == "bfloat16"
    header = _header(path / "model.safetensors")
    v, h = config["vocab_size"], 128
    assert header["model.embed_tokens.weight"]["shape"] == [v, h]
    assert header["model.layers.1.self_attn.q_proj.weight"]["shape"] == [4 * 64, h]
    assert header["model.layers.1.self_attn.k_proj.weight"]["shape"] == [2 * 64, h]
    assert header["model.layers.0.self_attn.o_proj.weight"]["shape"] == [h, 4 * 64]
    assert header["model.layers.0.self_attn.q_norm.weight"]["shape"] == [64]
    assert header["model.layers.0.mlp.down_proj.weight"]["shape"] == [h, config["intermediate_size"]]
    assert "lm_head.weight" in header and "model.layers.2.input_layernorm.weight" not in header
    assert {t["dtype"] for t in header.values()} == {"BF16"}
    assert len(header) == 1 + 2 * 11 + 1 + 1


def test_moe_model_has_per_expert_weights(tmp_path):
    path = make_tiny_model(tmp_path / "m", kind="qwen3_moe", tie_word_embeddings=True, dtype="float32")
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["num_experts"] == 8 and config["num_experts_per_tok"] == 2 and config["decoder_sparse_step"] == 1
    header = _header(path / "model.safetensors")
    assert header["model.layers.0.mlp.gate.weight"]["shape"] == [8, 128]
    assert header["model.layers.1.mlp.experts.7.down_proj.weight"]["shape"] == [128, config["moe_intermediate_size"]]
    assert "model.layers.0.mlp.gate_proj.weight" not in header  # every layer is sparse
    assert "lm_head.weight" not in header  # tied
    assert {t["dtype"] for t in header.values()} == {"F32"}


def test_float32_file_reads_back_with_safetensors(tmp_path):
    numpy_loader = pytest.importorskip("safetensors.numpy")
    path = make_tiny_model(tmp_path / "m", dtype="float32", seed=3)
    tensors = numpy_loader.load_file(str(path / "model.safetensors"))
    assert tensors["model.norm.weight"].dtype == np.float32
    np.testing.assert_array_equal(tensors["model.norm.weight"], 1.0)
    std = tensors["model.layers.0.mlp.up_proj.weight"].std()
    assert 0.015 < std < 0.025


def test_bf16_bits_round_to_nearest_even(tmp_path):
    from prime_rl.common.testing import _round_to_bf16_bits

    x = np.array([1.0, -2.5, 1 + 2**-8, 1 + 3 * 2**-9, 3.14159, 1e-30], dtype=np.float32)
    back = bf16_bits_to_float32(_round_to_bf16_bits(x))
    # exact: 1, -2.5; tie 1+2^-8 rounds to even (1.0); 1+3*2^-9 rounds up to 1+2^-7
    np.testing.assert_array_equal(back[:4], [1.0, -2.5, 1.0, 1 + 2**-7])
    np.testing.assert_allclose(back, x, rtol=2**-8)
    write_safetensors(tmp_path / "a.safetensors", {"w": _round_to_bf16_bits(x)})
    with open(tmp_path / "a.safetensors", "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        assert size % 8 == 0
        f.seek(8 + size)
        np.testing.assert_array_equal(np.frombuffer(f.read(), "<u2"), _round_to_bf16_bits(x))


def test_tokenizer_is_byte_level_with_single_id_specials(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    config = json.loads((path / "config.json").read_text())
    assert tokenizer.get_vocab_size() <= config["vocab_size"]
    text = "<|im_start|>user\nCafé ∑ 😀 never-seen-bytes\t<|im_end|>"
    encoding = tokenizer.encode(text)
    assert encoding.ids[0] == tokenizer.token_to_id("<|im_start|>")
    assert encoding.ids[-1] == tokenizer.token_to_id("<|im_end|>") == config["eos_token_id"]
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == text
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>" and tokenizer_config["chat_template"] == CHAT_TEMPLATE


def test_chat_template_renders_chatml():
    jinja2 = pytest.importorskip("jinja2")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = jinja2.Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    assert (
        rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_vocab_size_padding_and_refusal(tmp_path):
    path = make_tiny_model(tmp_path / "m", vocab_size=1024)
    assert _header(path / "model.safetensors")["lm_head.weight"]["shape"] == [1024, 128]
    with pytest.raises(ValueError, match="vocab_size=10 is below"):
        make_tiny_model(tmp_path / "n", vocab_size=10)
    with pytest.raises(ValueError, match="kind='llama'"):
        make_tiny_model(tmp_path / "o", kind="llama")
