"""Parallel-layout checks at config time (no torch): `sft`/`rl` `--dry-run` catch what would otherwise
fail minutes later on the GPUs: dp_replicate / cp / ep against the number of trainer ranks, cp against
the attention heads and Mamba-2 layers, ep against the experts (when the model's config.json is readable),
the batch against micro-batch x data-parallel ranks. Knobs that do nothing for this model (ep on a dense model)
warn instead of failing.

The trainer re-checks all of this at start-up with the resolved mesh; these are the same rules, written
so that the message names the keys (``model.cp=7 must divide ...``) and the config loader can say which
file or flag set them.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from prime_rl.common.config.base import ConfigWarning
from prime_rl.common.config.trainer import TorchDispatchConfig, TrainerModelConfig


class LayoutError(ValueError):
    """A layout that cannot run; ``keys`` are the dotted config keys it is about."""

    def __init__(self, message: str, keys: list[str]) -> None:
        super().__init__(message)
        self.keys = keys


@dataclass(frozen=True)
class ModelShape:
    """What the layout depends on, from a Hugging Face config.json."""

    num_attention_heads: int
    num_key_value_heads: int
    num_experts: int
    """0 for a dense model"""
    mamba: bool = False
    """Has Mamba-2 layers (Nemotron-H), which context parallelism does not cover"""


def read_hf_config(name: str | Path, requires: str | None = None) -> dict | None:
    """The text model's part of ``name``/config.json, read as JSON (no transformers import on the dry-run
    path); None when there is no readable config.json, or when it has no whole number under ``requires`` (the
    key a reader cannot do without: it then knows nothing about the model, as with no config.json)."""
    try:
        hf = json.loads((Path(name) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    hf = hf.get("text_config", hf) if isinstance(hf, dict) else None
    if hf is None or (requires is not None and not isinstance(hf.get(requires), int)):
        return None
    return hf


def read_model_shape(name: str | Path) -> ModelShape | None:
    """The shape of the model in local directory ``name``; None when there is no readable config.json."""
    hf = read_hf_config(name, requires="num_attention_heads")
    if hf is None:
        return None
    heads = hf["num_attention_heads"]
    experts = hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0
    return ModelShape(heads, hf.get("num_key_value_heads") or heads, int(experts), _has_mamba(hf))


def _has_mamba(hf: dict) -> bool:
    """Nemotron-H's layer list: `layers_block_type` (transformers>=5) or else `hybrid_override_pattern` ("M")."""
    if hf.get("model_type") != "nemotron_h":
        return False
    blocks = hf.get("layers_block_type")
    if isinstance(blocks, list) and blocks:
        return "linear_attention" in blocks
    return "M" in str(hf.get("hybrid_override_pattern") or "")


def _ranks(n: int) -> str:
    return "1 rank" if n == 1 else f"{n} ranks"


def _divisors(n: int) -> str:
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ds[0] if len(ds) == 1 else f"{', '.join(ds[:-1])} or {ds[-1]}"


def check_layout(
    model: TrainerModelConfig,
    world_size: int | None,
    shape: ModelShape | None,
    prefix: str = "",
    world_key: str = "deployment.num_gpus",
) -> None:
    """Raise LayoutError for a layout that cannot run; warn (ConfigWarning) for knobs that do nothing.

    ``prefix`` is where the model table sits ("" for sft, "trainer." for rl); ``world_size`` None skips the
    rank-count rules (the count is not known yet).
    """
    m = f"{prefix}model"
    if world_size is not None:
        if world_size % model.dp_replicate:
            raise LayoutError(
                f"{m}.dp_replicate={model.dp_replicate} must divide the trainer's {_ranks(world_size)} "
                f"({world_key}={world_size}); use {_divisors(world_size)}",
                [f"{m}.dp_replicate", world_key],
            )
        island = world_size // model.dp_replicate
        if island % model.cp:
            raise LayoutError(
                f"{m}.cp={model.cp} must divide the {_ranks(island)} of an FSDP island ({world_key}={world_size} "
                f"// {m}.dp_replicate={model.dp_replicate}); use {_divisors(island)} or add ranks",
                [f"{m}.cp", world_key],
            )
    if shape is None:
        return
    if model.cp > 1 and shape.mamba:  # the trainer's rule (prime_rl.trainer.parallel.layout)
        raise LayoutError(
            f"{m}.cp={model.cp}: context parallelism is not implemented for Mamba-2 layers ({model.name} has them: "
            f"the scan would need the previous rank's state); use {m}.cp=1",
            [f"{m}.cp"],
        )
    heads, kv = shape.num_attention_heads, shape.num_key_value_heads
    if heads % model.cp:
        raise LayoutError(
            f"{m}.cp={model.cp} must divide the model's num_attention_heads={heads}; use {_divisors(heads)}",
            [f"{m}.cp"],
        )
    if kv % model.cp and model.cp % kv:
        fits = [str(d) for d in range(1, heads + 1) if heads % d == 0 and (kv % d == 0 or d % kv == 0)]
        raise LayoutError(
            f"{m}.cp={model.cp} must divide the model's num_key_value_heads={kv} or be a multiple of it (KV heads are "
            f"replicated up to cp); use {', '.join(fits[:-1])} or {fits[-1]}",
            [f"{m}.cp"],
        )
    if shape.num_experts == 0:
        if model.moe.router_replay:
            raise LayoutError(
                f"{m}.moe.router_replay=true but {model.name} is a dense model (no experts, nothing to route); "
                "remove it or train a MoE model",
                [f"{m}.moe.router_replay"],
            )
        if isinstance(model.ep, int) and model.ep > 1:
            warnings.warn(
                f"{m}.ep={model.ep} has no effect: {model.name} is a dense model (no experts); remove it",
                ConfigWarning,
                stacklevel=2,
            )
        if not isinstance(model.moe.dispatch, TorchDispatchConfig):
            warnings.warn(
                f'{m}.moe.dispatch.type="{model.moe.dispatch.type}" has no effect: {model.name} is a dense model',
                ConfigWarning,
                stacklevel=2,
            )
    elif isinstance(model.ep, int) and shape.num_experts % model.ep:
        raise LayoutError(
            f"{m}.ep={model.ep} must divide the model's {shape.num_experts} experts; use {_divisors(shape.num_experts)}",
            [f"{m}.ep"],
        )
    elif (
        isinstance(model.ep, int) and world_size is not None and (island := world_size // model.dp_replicate) % model.ep
    ):
        raise LayoutError(
            f"{m}.ep={model.ep} must divide the {_ranks(island)} of an FSDP island ({world_key}={world_size} "
            f"// {m}.dp_replicate={model.dp_replicate}); use {_divisors(island)}",
            [f"{m}.ep", world_key],
        )


def check_batch(batch_size: int, micro_batch_size: int, dp: int, prefix: str = "", world_key: str = "") -> None:
    """Every data-parallel rank runs the same number of whole micro-batches per step."""
    d = f"{prefix}data"
    if batch_size % (micro_batch_size * dp):
        step = micro_batch_size * dp
        fix = max(step, batch_size // step * step)
        raise LayoutError(
            f"{d}.batch_size={batch_size} must be a multiple of {d}.micro_batch_size={micro_batch_size} x {dp} "
            f"data-parallel ranks = {step}; use batch_size={fix}",
            [f"{d}.batch_size", f"{d}.micro_batch_size", *([world_key] if world_key else [])],
        )
