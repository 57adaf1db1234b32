"""Hugging Face safetensors <-> model state dict: pure name/shape converters plus file IO.

Model names are HF names without the `model.` prefix, except for MoE layers:
    HF  model.layers.{i}.mlp.gate.weight                    (E, H)
    HF  model.layers.{i}.mlp.experts.{e}.gate_proj.weight   (I, H)   x E
    us  layers.{i}.mlp.router.weight                        (E, H)
    us  layers.{i}.mlp.experts.gate_proj                    (E, I, H)  (same for up_proj, down_proj)
    HF  model.layers.{i}.mlp.gate.e_score_correction_bias   (E,)     GLM-4.5's routing bias (a buffer)
    us  layers.{i}.mlp.router.e_score_correction_bias
GLM-4.5 checkpoints also hold multi-token-prediction layers after the last decoder layer
(`model.layers.{num_hidden_layers + j}`, `num_nextn_predict_layers`); training does not use them, so
loading skips them and a saved checkpoint does not have them (vLLM serves it without speculative MTP).
Stacking and unstacking copy values unchanged, so load -> save reproduces a checkpoint bit for bit
(same names, dtypes and values) when the model is built in the checkpoint's dtype.

Nemotron-H checkpoints name the decoder `backbone.` (not `model.`), its embedding `embeddings` and its
final norm `norm_f` (ours: `embed_tokens`, `norm`); their experts are `layers.{i}.mixer.experts.{e}.
{up,down}_proj.weight`, stacked into `layers.{i}.mixer.experts.{up,down}_proj` (E, ...); Nemotron-3's
multi-token-prediction weights (`mtp.*`) are skipped as for GLM-4.5.

`load_hf_weights` reads every tensor on every rank and copies the local shard into DTensor
parameters (after `fully_shard`) without communication; for very large models the training loop may
prefer rank-0 loading with `set_model_state_dict(..., broadcast_from_rank0=True)` over the converters.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from prime_rl.trainer.models.config import ArchConfig, load_arch_config

_EXPERT_RE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_ROUTER_HF_RE = re.compile(r"^layers\.(\d+)\.mlp\.gate\.weight$")
_ROUTER_RE = re.compile(r"^layers\.(\d+)\.mlp\.router\.weight$")
_ROUTER_BIAS_HF_RE = re.compile(r"^layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$")
_ROUTER_BIAS_RE = re.compile(r"^layers\.(\d+)\.mlp\.router\.e_score_correction_bias$")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.")
_STACKED_RE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)$")
_NH_EXPERT_RE = re.compile(r"^layers\.(\d+)\.mixer\.experts\.(\d+)\.(up_proj|down_proj)\.weight$")
_NH_STACKED_RE = re.compile(r"^layers\.(\d+)\.mixer\.experts\.(up_proj|down_proj)$")
# Nemotron-H's own names for the modules every model shares (HF name -> ours).
_NH_RENAMES = {"embeddings.weight": "embed_tokens.weight", "norm_f.weight": "norm.weight"}
# Files copied next to saved weights so the directory is a complete HF model (tokenizer, templates).
_SIDE_FILE_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
WEIGHT_INDEX = "model.safetensors.index.json"


def hf_state_dict_to_model(sd: dict[str, torch.Tensor], config: ArchConfig) -> dict[str, torch.Tensor]:
    """HF names/shapes -> model names/shapes. Tied models get `lm_head.weight` = the embedding."""
    if config.model_type == "nemotron_h":
        return _nemotron_h_to_model(sd, config)
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for hf_name, tensor in sd.items():
        if hf_name.endswith("rotary_emb.inv_freq"):  # old checkpoints saved the RoPE buffer
            continue
        name = hf_name.removeprefix("model.")
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # some tied checkpoints still store the head; the embedding is the source of truth
        if (m := _LAYER_RE.match(name)) and int(m[1]) >= config.num_hidden_layers and config.model_type == "glm4_moe":
            continue  # GLM-4.5's multi-token-prediction layers (see the module docstring)
        if m := _EXPERT_RE.match(name):
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = tensor
        elif m := _ROUTER_HF_RE.match(name):
            out[f"layers.{m[1]}.mlp.router.weight"] = tensor
        elif m := _ROUTER_BIAS_HF_RE.match(name):
            out[f"layers.{m[1]}.mlp.router.e_score_correction_bias"] = tensor
        else:
            out[name] = tensor

    def layer_kind(layer: int) -> str:
        return f"a MoE with {config.num_experts} experts" if config.is_moe_layer(layer) else "dense"

    return _stacked_and_tied(out, experts, config, "layers.{}.mlp.experts.{}", layer_kind)


def _stacked_and_tied(
    out: dict[str, torch.Tensor],
    experts: dict[tuple[int, str], dict[int, torch.Tensor]],
    config: ArchConfig,
    stacked_name: str,
    layer_kind: Callable[[int], str],
) -> dict[str, torch.Tensor]:
    """HF -> model names, for every architecture: ``out`` plus each (layer, projection)'s experts stacked into
    ``stacked_name.format(layer, projection)``, and a tied LM head as the embedding. A layer whose experts are not
    exactly the config's is refused, naming what the config makes that layer (``layer_kind(layer)``)."""
    for (layer, proj), by_expert in experts.items():
        if sorted(by_expert) != list(range(config.num_experts)) or not config.is_moe_layer(layer):
            raise ValueError(
                f"layer {layer} {proj}: the checkpoint has {len(by_expert)} experts (ids {min(by_expert)}.."
                f"{max(by_expert)}) but the config makes this layer {layer_kind(layer)}; "
                "check that config.json belongs to these weights"
            )
        out[stacked_name.format(layer, proj)] = torch.stack([by_expert[e] for e in range(config.num_experts)])
    if config.tie_word_embeddings and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def model_state_dict_to_hf(sd: dict[str, torch.Tensor], config: ArchConfig) -> dict[str, torch.Tensor]:
    """Model names/shapes -> HF names/shapes (tied models drop `lm_head.weight`, as HF saves them)."""
    if config.model_type == "nemotron_h":
        ours_to_hf = {v: k for k, v in _NH_RENAMES.items()}
        return _unstacked_to_hf(
            sd, config, _NH_STACKED_RE, "backbone.layers.{}.mixer.experts.{}.{}.weight",
            lambda name: "backbone." + ours_to_hf.get(name, name),
        )  # fmt: skip
    return _unstacked_to_hf(sd, config, _STACKED_RE, "model.layers.{}.mlp.experts.{}.{}.weight", _hf_name)


def _hf_name(name: str) -> str:
    """The HF name of a model tensor that is neither the LM head nor stacked experts."""
    if m := _ROUTER_RE.match(name):
        return f"model.layers.{m[1]}.mlp.gate.weight"
    if m := _ROUTER_BIAS_RE.match(name):
        return f"model.layers.{m[1]}.mlp.gate.e_score_correction_bias"
    return f"model.{name}"


def _unstacked_to_hf(
    sd: dict[str, torch.Tensor],
    config: ArchConfig,
    stacked: re.Pattern[str],
    expert_name: str,
    hf_name: Callable[[str], str],
) -> dict[str, torch.Tensor]:
    """Model -> HF names, for every architecture: a tied LM head is dropped, stacked experts (``stacked`` matches
    their name: layer, projection) are split into ``expert_name.format(layer, expert, projection)``, every other
    tensor is renamed by ``hf_name``."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in sd.items():
        if name == "lm_head.weight":
            if not config.tie_word_embeddings:
                out[name] = tensor
        elif m := stacked.match(name):
            for e, expert_weight in enumerate(tensor.unbind(0)):
                out[expert_name.format(m[1], e, m[2])] = expert_weight
        else:
            out[hf_name(name)] = tensor
    return out


def _nemotron_h_to_model(sd: dict[str, torch.Tensor], config: ArchConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for hf_name, tensor in sd.items():
        if hf_name.startswith("mtp."):
            continue  # multi-token-prediction layers (see the module docstring)
        name = hf_name.removeprefix("backbone.").removeprefix("model.")
        name = _NH_RENAMES.get(name, name)
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if m := _NH_EXPERT_RE.match(name):
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = tensor
        else:
            out[name] = tensor

    def layer_kind(layer: int) -> str:
        return f"{config.layer_types[layer]!r} with {config.num_experts} experts"

    return _stacked_and_tied(out, experts, config, "layers.{}.mixer.experts.{}", layer_kind)


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / WEIGHT_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}; pass a Hugging Face model directory")
    return files


def read_hf_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint, on CPU, in its stored dtype."""
    sd: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                sd[key] = f.get_tensor(key)
    return sd


@torch.no_grad()
def load_hf_weights(model: nn.Module, model_dir: str | Path, ignore: Callable[[str], bool] | None = None) -> None:
    """Copy an HF checkpoint into `model` (plain or DTensor parameters), casting to each parameter's dtype.
    State-dict keys for which `ignore(name)` is true (LoRA adapters) are not in the checkpoint and stay as they are."""
    config: ArchConfig = model.config
    sd = hf_state_dict_to_model(read_hf_state_dict(model_dir), config)
    targets = {k: v for k, v in model.state_dict().items() if ignore is None or not ignore(k)}
    missing, unexpected = sorted(set(targets) - set(sd)), sorted(set(sd) - set(targets))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {model_dir} does not match the model: missing {missing[:5]} ({len(missing)}), "
            f"unexpected {unexpected[:5]} ({len(unexpected)}); check that config.json belongs to these weights"
        )
    for name, target in targets.items():
        _copy_into(target, sd[name], name)


def _copy_into(target: torch.Tensor, full: torch.Tensor, name: str) -> None:
    if target.is_meta:
        raise RuntimeError(f"{name} is on the meta device; call model.to_empty(device=...) before loading weights")
    if tuple(target.shape) != tuple(full.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(full.shape)} != model shape {tuple(target.shape)}")
    if hasattr(target, "device_mesh"):  # DTensor after fully_shard: keep only this rank's shard
        from torch.distributed.tensor import distribute_tensor

        local_device = target.to_local().device
        shard = distribute_tensor(
            full.to(device=local_device, dtype=target.dtype), target.device_mesh, target.placements, src_data_rank=None
        )
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(full)


def _to_full_cpu(tensor: torch.Tensor) -> torch.Tensor:
    if hasattr(tensor, "full_tensor"):  # DTensor: gather (collective; every rank must call save)
        tensor = tensor.full_tensor()
    tensor = tensor.detach().cpu()
    # safetensors refuses tensors sharing storage (unstacked experts are views of one tensor).
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def save_hf_weights(
    state_dict_or_model: dict[str, torch.Tensor] | nn.Module,
    out_dir: str | Path,
    config: ArchConfig | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write HF-named safetensors (sharded with an index above `max_shard_bytes`) plus config.json and
    the tokenizer files of the directory the config came from."""
    if isinstance(state_dict_or_model, nn.Module):
        config = config or state_dict_or_model.config
        state_dict = state_dict_or_model.state_dict()
    else:
        state_dict = state_dict_or_model
    if config is None:
        raise ValueError("save_hf_weights needs `config` when given a state dict (ArchConfig, dir or dict)")
    config = load_arch_config(config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Gather before converting: unstacking experts needs the whole (E, ...) tensor, not a DTensor shard.
    tied = config.tie_word_embeddings
    full_sd = {k: _to_full_cpu(v) for k, v in state_dict.items() if not (tied and k == "lm_head.weight")}
    hf_sd = {k: _to_full_cpu(v) for k, v in model_state_dict_to_hf(full_sd, config).items()}
    # A previous save with another sharding would leave files that loaders pick up next to ours.
    for stale in [*out_dir.glob("*.safetensors"), out_dir / WEIGHT_INDEX]:
        stale.unlink(missing_ok=True)
    write_shards(hf_sd, out_dir, max_shard_bytes)
    write_side_files(config, out_dir)


def _save_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    save_file(tensors, str(path), metadata=metadata)


def write_shards(
    hf_sd: Mapping[str, torch.Tensor],
    out_dir: Path,
    max_shard_bytes: int,
    write: Callable[[Path, dict[str, torch.Tensor], dict[str, str]], None] = _save_file,
) -> None:
    """HF-named tensors as ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards of at
    most ``max_shard_bytes`` plus the index; ``write(path, tensors, metadata)`` writes one file."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in hf_sd.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        write(out_dir / "model.safetensors", shards[0], {"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write(out_dir / file_name, shard, {"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    total = sum(t.numel() * t.element_size() for t in hf_sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / WEIGHT_INDEX).write_text(json.dumps(index, indent=2))


def write_side_files(config: ArchConfig, out_dir: Path) -> None:
    """config.json and the source directory's tokenizer / generation files next to the weights."""
    if config.source_dir and Path(config.source_dir).resolve() != out_dir.resolve():
        for path in Path(config.source_dir).iterdir():
            if path.is_file() and path.suffix in _SIDE_FILE_SUFFIXES and path.name != WEIGHT_INDEX:
                shutil.copy2(path, out_dir / path.name)
    if config.hf_config:
        (out_dir / "config.json").write_text(json.dumps(config.hf_config, indent=2) + "\n")
