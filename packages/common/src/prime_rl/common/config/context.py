"""Sequence lengths of an `rl` run, checked at config time (no torch, no transformers: config.json is read
as JSON), so `rl --dry-run` refuses what would otherwise fail minutes later or waste the run.

A sample is prompt + completion. Inference (vLLM) refuses a request whose prompt alone fills
`inference.vllm.max_model_len` (HTTP 400) and ends a completion where prompt + completion reaches it
(finish_reason "length"); the orchestrator packs whole samples into trainer rows of `seq_len` tokens and
drops (counts, logs) a sample longer than a row, never cutting it. Hence:

- `max_model_len <= seq_len`: inference never samples what the trainer cannot take whole. Unset in `rl`,
  max_model_len is seq_len, capped at the model's context (a row may pack several samples, so seq_len above
  the context is fine: positions restart at every sample).
- `max_model_len <= ` the model's context (`max_position_embeddings`, scaled by RoPE scaling as vLLM does,
  capped by the tokenizer's `model_max_length`): vLLM refuses to start otherwise, unless
  VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 is in its environment.
- `sampling.max_tokens < max_model_len`: room for at least a one-token prompt (the orchestrator's own rule,
  `max_tokens < seq_len`, is the same against seq_len).
- `orchestrator.seq_len == trainer.data.seq_len`: the trainer sizes its forwards and memory plan for the rows
  it receives.

Prompt lengths are not known before the environments run (they need the tokenizer and chat template), so
`max_tokens` + the longest prompt is not checked here: vLLM shortens a completion that would pass
max_model_len, and the orchestrator drops a sample longer than seq_len with its task named.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from prime_rl.common.config.layout import read_hf_config

ALLOW_LONG_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
"""vLLM's switch that lets max_model_len pass the model's context."""

# Like vLLM's _get_and_verify_max_len: these RoPE types leave max_position_embeddings already scaled.
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


@dataclass(frozen=True)
class ModelContext:
    """The longest sequence a model serves, and where the number comes from (for messages)."""

    max_len: int
    source: str
    """e.g. "max_position_embeddings=40960" or "max_position_embeddings=32768 x rope factor 4.0"."""


def read_model_context(name: str | Path) -> ModelContext | None:
    """The context of the local model directory ``name``; None when config.json is unreadable or has no
    max_position_embeddings."""
    hf = read_hf_config(name, requires="max_position_embeddings")
    if hf is None:
        return None
    positions = hf["max_position_embeddings"]
    max_len, source = positions, f"max_position_embeddings={positions}"
    rope = hf.get("rope_scaling") or hf.get("rope_parameters")
    if isinstance(rope, dict) and "gemma3" not in str(hf.get("model_type", "")):
        kind = rope.get("rope_type") or rope.get("type") or "default"
        factor = rope.get("factor")
        if kind not in _PRESCALED_ROPE and isinstance(factor, (int, float)) and factor != 1:
            max_len, source = int(positions * factor), f"{source} x rope factor {factor}"
    try:
        tokenizer = json.loads((Path(name) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tokenizer = {}
    limit = tokenizer.get("model_max_length")
    if isinstance(limit, int) and limit < max_len:
        max_len, source = limit, f"tokenizer model_max_length={limit}"
    return ModelContext(max_len, source)


def long_context_allowed(env_vars: dict[str, str]) -> bool:
    value = env_vars.get(ALLOW_LONG_ENV, os.environ.get(ALLOW_LONG_ENV, ""))
    return value.strip().lower() in ("1", "true")


def fit_max_model_len(
    max_model_len: int | None,
    seq_len: int,
    trainer_seq_len: int,
    max_tokens: int,
    context: ModelContext | None,
    allow_long: bool = False,
) -> int:
    """The max_model_len inference serves with (``max_model_len`` when set, else seq_len capped at the model's
    context); raises ValueError naming the keys when the lengths do not fit together (module docstring)."""
    if trainer_seq_len != seq_len:
        raise ValueError(
            f"orchestrator.seq_len={seq_len} but trainer.data.seq_len={trainer_seq_len}: the trainer sizes its "
            "forwards and memory plan for the rows it receives; set seq_len once at the top level (it sets both)"
        )
    if max_model_len is None:
        fitted = seq_len if context is None else min(seq_len, context.max_len)
        if max_tokens >= fitted:  # only when the model's context is below seq_len: max_tokens < seq_len holds
            assert context is not None
            raise ValueError(
                f"orchestrator.sampling.max_tokens={max_tokens} leaves no room for a prompt: inference serves at "
                f"most the model's {context.source} tokens (prompt + completion); lower sampling.max_tokens "
                f"below {fitted}"
            )
        return fitted
    if max_model_len > seq_len:
        raise ValueError(
            f"inference.vllm.max_model_len={max_model_len} is above seq_len={seq_len}: inference would sample "
            f"prompt + completion up to {max_model_len} tokens, and a sample longer than a trainer row is dropped "
            f"(never cut); set inference.vllm.max_model_len <= {seq_len} (or leave it unset: rl uses seq_len), "
            "or raise seq_len"
        )
    if context is not None and max_model_len > context.max_len and not allow_long:
        raise ValueError(
            f"inference.vllm.max_model_len={max_model_len} is above the model's {context.source} (config.json): "
            f"vLLM refuses to start; set it to at most {context.max_len}, or set {ALLOW_LONG_ENV}=1 under "
            "[inference.env_vars] if the model extrapolates"
        )
    if max_tokens >= max_model_len:
        raise ValueError(
            f"orchestrator.sampling.max_tokens={max_tokens} leaves no room for a prompt in "
            f"inference.vllm.max_model_len={max_model_len} (prompt + completion); lower sampling.max_tokens "
            f"below {max_model_len} or raise max_model_len"
        )
    return max_model_len
