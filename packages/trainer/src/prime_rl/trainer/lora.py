"""LoRA: low-rank adapters on a frozen base, trained under the same FSDP2 / AC / compile / fused LM head.

    y = W x + b + (alpha / r) * B A dropout(x)        A: (r, in), B: (out, r)

Design decisions:
- `LoRALinear` subclasses `nn.Linear` and takes over the base layer's own `weight` / `bias` Parameters,
  adding `lora_A` and `lora_B`. Module and parameter names stay those of the Hugging Face checkpoint
  (`layers.0.self_attn.q_proj.weight`), so base loading, per-block FSDP wrapping and AC are unchanged and the
  adapters are sharded, all-gathered (bf16) and reduce-scattered with their block like any other parameter.
- `apply_lora` runs on the meta model before `parallelize_model` and turns `requires_grad` off for everything
  but the adapters and `modules_to_save`. The optimizer takes only parameters that require grad, so the base has
  no gradient and no optimizer state; FSDP2 reduce-scatters only the gradients that exist. The frozen base is
  stored in bf16 (what compute casts it to anyway); trainable tensors keep fp32 masters.
- Initialization as peft: A kaiming-uniform(a=sqrt(5)), B = 0, so step 0 is exactly the base model. A is drawn
  whole on the CPU from a seeded generator and each rank keeps its shard: the same values at any world size.
- Checkpoints hold the trainable tensors and their optimizer state only (DCP with `ignore_frozen_params`); the
  base is read from `model.name` again on resume. Export is the peft format (adapter_config.json +
  adapter_model.safetensors, keys `base_model.model.<HF module>.lora_A.weight`), which peft, vLLM and
  transformers load, and optionally merged HF weights W + (alpha / r) B A.
- Bad input fails before any weight is read (`check_lora`, on a meta model): a target pattern that matches no
  linear layer, a rank above min(in, out) of a targeted layer, an adapted LM head.

- RL's KL reference is `BaseModelView(policy)`: the policy with its adapters off, i.e. the initial policy.

Left out: adapters on MoE routers and routed experts (their weights are not `nn.Linear`), on the embedding and
on the LM head (the fused LM head reads its weight directly); `modules_to_save` trains any of them in full.
rsLoRA / DoRA, several adapters in one trainer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from prime_rl.common.config.trainer import LoRAConfig
from prime_rl.common.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from prime_rl.trainer.models import (
    build_model,
    model_flops_per_token,
    model_state_dict_to_hf,
    num_active_params,
    save_hf_weights,
)
from prime_rl.trainer.models.config import ArchConfig

PEFT_PREFIX = "base_model.model."
LORA_LEAVES = ("lora_A", "lora_B")


class LoRALinear(nn.Linear):
    """A linear layer with a trainable low-rank update; `weight` and `bias` are the base layer's own Parameters."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.rank = rank
        self.scaling = alpha / rank
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.zeros(rank, self.in_features, **factory))  # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **factory))  # (out, r)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)  # (..., out)
        delta = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)  # (..., r) -> (..., out)
        return out + delta * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling:g}"


def _matches(name: str, patterns: list[str] | str) -> bool:
    """peft's rule: a list matches by module-name suffix, a string is a regex over the whole name."""
    if isinstance(patterns, str):
        return re.fullmatch(patterns, name) is not None
    return any(name == p or name.endswith("." + p) for p in patterns)


def hf_module_name(name: str) -> str:
    """Our module name -> the Hugging Face one (the prefix, and the MoE router, which HF calls `gate`)."""
    if name == "lm_head":
        return name
    return "model." + re.sub(r"^(layers\.\d+\.mlp)\.router$", r"\1.gate", name)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_enabled(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def apply_lora(model: nn.Module, cfg: LoRAConfig, trainable_dtype: torch.dtype | None = None) -> list[str]:
    """Swap the targeted linear layers of `model` (a Transformer, usually on meta) for `LoRALinear` and freeze
    every other parameter except those of `modules_to_save`; the trainable ones are cast to `trainable_dtype`
    (FSDP2 needs one dtype among a unit's trainable parameters only). Returns the adapted module names.
    Raises ValueError (value, rule, fix) on a pattern that matches nothing or a rank above a layer's size."""
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    targets = [name for name in linears if _matches(name, cfg.target_modules)]
    patterns = cfg.target_modules if isinstance(cfg.target_modules, list) else [cfg.target_modules]
    for pattern in patterns:  # each entry must adapt something: a typo is an error, not a silent no-op
        if not any(_matches(name, [pattern] if isinstance(cfg.target_modules, list) else pattern) for name in linears):
            suffixes = sorted({name.rsplit(".", 1)[-1] for name in linears})
            raise ValueError(
                f"model.lora.target_modules entry {pattern!r} matches no linear layer of the model; list suffixes "
                f"of its linear layers ({', '.join(suffixes)}) or a regex over full names like "
                f"{next(iter(linears))!r} (MoE routers and routed experts are not linear layers)"
            )
    if "lm_head" in targets:
        raise ValueError(
            "model.lora.target_modules matches lm_head, which the fused LM head reads directly and cannot be "
            'adapted; remove it from target_modules and add "lm_head" to model.lora.modules_to_save to train it in full'
        )
    for name in targets:
        layer = linears[name]
        limit = min(layer.in_features, layer.out_features)
        if cfg.rank > limit:
            raise ValueError(
                f"model.lora.rank={cfg.rank} exceeds {name} ({layer.in_features} -> {layer.out_features}): a rank "
                f"must be <= min(in, out) = {limit}; use rank <= {limit} or leave that layer out of target_modules"
            )
    for pattern in cfg.modules_to_save:
        if not any(_matches(name, [pattern]) for name, _ in model.named_modules()):
            raise ValueError(
                f"model.lora.modules_to_save entry {pattern!r} matches no module of the model; use a module-name "
                'suffix such as "lm_head", "embed_tokens" or "norm"'
            )
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(linears[name], cfg.rank, cfg.alpha, cfg.dropout))
    model.requires_grad_(False)
    for module in lora_modules(model).values():
        module.lora_A.requires_grad_(True)
        module.lora_B.requires_grad_(True)
    for name, module in model.named_modules():
        if _matches(name, cfg.modules_to_save):
            module.requires_grad_(True)
    if trainable_dtype is not None:
        for param in model.parameters():
            if param.requires_grad and param.dtype != trainable_dtype:
                param.data = param.data.to(trainable_dtype)
    model.lora_config = cfg
    return targets


def check_lora(cfg: LoRAConfig, model_config: ArchConfig) -> list[str]:
    """`apply_lora` on a meta copy of the model: every LoRA input check, before any weight is read."""
    return apply_lora(build_model(model_config, device="meta"), cfg)


def set_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a whole tensor into a (possibly FSDP-sharded) parameter: each rank keeps its own shard."""
    if isinstance(param, DTensor):
        local = param.to_local()
        shard = distribute_tensor(
            full.to(device=local.device, dtype=param.dtype), param.device_mesh, param.placements, src_data_rank=None
        )
        local.copy_(shard.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def init_lora_weights(model: nn.Module, seed: int) -> None:
    """peft's init: A ~ kaiming-uniform(a=sqrt(5)), B = 0 (step 0 is the base model), drawn whole on the CPU
    from one seeded generator in module order, so every world size gets the same adapters."""
    generator = torch.Generator().manual_seed(seed)
    for module in lora_modules(model).values():
        a = torch.empty(tuple(module.lora_A.shape), dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        set_full(module.lora_A, a)
        set_full(module.lora_B, torch.zeros(tuple(module.lora_B.shape)))


def is_lora_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in LORA_LEAVES


def num_trainable_params(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts of the whole (unsharded) model; a tied weight counts once."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def log_lora(model: nn.Module, logger: logging.Logger) -> None:
    """One line on what trains: adapted layers, rank, trainable parameters (nothing without LoRA)."""
    inner = getattr(model, "model", model)
    cfg: LoRAConfig | None = getattr(inner, "lora_config", None)
    if cfg is None:
        return
    trainable, total = num_trainable_params(model)
    logger.info(
        f"LoRA rank {cfg.rank}, alpha {cfg.alpha:g} on {len(lora_modules(model))} layers"
        f"{' + ' + ', '.join(cfg.modules_to_save) + ' in full' if cfg.modules_to_save else ''}: "
        f"{trainable:,} of {total:,} parameters train ({trainable / total:.2%})"
    )


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside the block every adapter's update is multiplied by 0: the model computes its frozen base."""
    modules = list(lora_modules(model).values())
    scalings = [m.scaling for m in modules]
    for m in modules:
        m.scaling = 0.0
    try:
        yield
    finally:
        for m, scaling in zip(modules, scalings, strict=True):
            m.scaling = scaling


class BaseModelView:
    """The policy with its adapters switched off, called like the policy: its frozen base, which is the initial
    policy (B = 0 at step 0). LoRA RL's KL reference without a second copy of the weights; valid because RL
    refuses modules_to_save (nothing else moves). Call it under no_grad, outside the policy's forward (the RL
    loop calls it first: the token-level loss reads the reference inside the policy's forward); activation
    checkpoints recompute in backward with the adapters on again."""

    def __init__(self, policy: nn.Module) -> None:
        self.policy = policy

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204 - the policy's own signature
        with adapters_disabled(self.policy):
            return self.policy(*args, **kwargs)


def training_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token for MFU (`models.flops`' convention), counting what LoRA really computes: a
    frozen weight costs 4 FLOPs per parameter (forward + input gradient, no weight gradient) instead of 6, an
    adapter or a module trained in full 6. Without LoRA: `model_flops_per_token`."""
    inner = getattr(model, "model", model)
    flops = model_flops_per_token(inner.config, seq_len)
    if not lora_enabled(inner):
        return flops
    adapters = sum(m.lora_A.numel() + m.lora_B.numel() for m in lora_modules(inner).values())
    # weights trained in full that a token multiplies: the embedding is a lookup, unless it is tied, when the
    # LM head multiplies it (`named_parameters` lists the tied matrix once, as `embed_tokens.weight`)
    full = sum(p.numel() for n, p in inner.named_parameters() if p.requires_grad and not is_lora_param(n))
    embedding = inner.embed_tokens.weight
    if embedding.requires_grad and not inner.config.tie_word_embeddings:
        full -= embedding.numel()
    return flops - 2 * num_active_params(inner.config) + 2 * full + 6 * adapters


def checkpoint_options(model: nn.Module) -> StateDictOptions:
    """DCP state-dict options: with LoRA only trainable tensors (and their optimizer state) are saved and
    loaded; `strict=False` because the frozen base is absent from the checkpoint (DCP still fails on a
    missing trainable tensor). Without LoRA: torch's defaults."""
    if not lora_enabled(model):
        return StateDictOptions()
    return StateDictOptions(ignore_frozen_params=True, strict=False)


# --- peft format --------------------------------------------------------------------------------------------


def _trainable_state(root: nn.Module, full: bool) -> dict[str, torch.Tensor]:
    """Trainable tensors in model names (no `model.` prefix). Collective: every rank calls it; with `full`
    rank 0 gets whole CPU tensors and the other ranks an empty dict."""
    options = StateDictOptions(full_state_dict=full, cpu_offload=full, ignore_frozen_params=True)
    sd = get_model_state_dict(root, options=options)
    return {k.removeprefix("model."): v for k, v in sd.items()}


def peft_state_dict(sd: dict[str, torch.Tensor], config: ArchConfig) -> dict[str, torch.Tensor]:
    """Model-named trainable tensors -> peft adapter keys (`base_model.model.<HF name>`, `.lora_A.weight`)."""
    out: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    for name, tensor in sd.items():
        module, _, leaf = name.rpartition(".")
        if leaf in LORA_LEAVES:
            out[f"{PEFT_PREFIX}{hf_module_name(module)}.{leaf}.weight"] = tensor
        else:
            rest[name] = tensor
    for hf_name, tensor in model_state_dict_to_hf(rest, config).items():  # modules_to_save, trained in full
        out[PEFT_PREFIX + hf_name] = tensor
    return out


def _peft_target_modules(adapted: list[str], all_linear: list[str]) -> list[str] | str:
    """The adapted modules as peft target_modules: suffixes when those pick exactly the adapted set, else one
    regex that names each adapted HF module."""
    hf = [hf_module_name(n) for n in adapted]
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in hf})
    picked = [n for n in map(hf_module_name, all_linear) if n.rsplit(".", 1)[-1] in suffixes]
    if sorted(picked) == sorted(hf):
        return suffixes
    return "^(" + "|".join(re.escape(n) for n in hf) + ")$"


def adapter_config(model: nn.Module, base_model: str) -> dict:
    """adapter_config.json of the adapters `apply_lora` put on `model` (the Transformer)."""
    cfg: LoRAConfig = model.lora_config
    adapted = list(lora_modules(model))
    all_linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    modules_to_save = sorted({hf_module_name(n).rsplit(".", 1)[-1] for n, _ in model.named_modules()
                              if n and _matches(n, cfg.modules_to_save)})  # fmt: skip
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": _peft_target_modules(adapted, all_linear),
        "modules_to_save": modules_to_save or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def write_adapter_dir(out_dir: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """adapter_model.safetensors + adapter_config.json (peft's layout) into `out_dir`."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def merge_lora(sd: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """Full model-named state dict with adapters -> plain weights W + scaling * B A (computed in fp32)."""
    out = {k: v for k, v in sd.items() if not is_lora_param(k)}
    for name in [k for k in sd if k.endswith(".lora_A")]:
        module = name.removesuffix(".lora_A")
        weight = out[f"{module}.weight"]
        delta = sd[f"{module}.lora_B"].float() @ sd[name].float()  # (out, r) @ (r, in)
        out[f"{module}.weight"] = (weight.float() + scaling * delta).to(weight.dtype)
    return out


def export_lora(root: nn.Module, out_dir: Path, is_main: bool, merged: bool = False) -> None:
    """Write the adapter in peft format to `out_dir` and, with `merged`, the merged HF weights (bf16) to
    `out_dir/merged`. `root` is the FSDP root (a CausalLM); collective: every rank calls it."""
    inner = root.model
    config = inner.config
    sd = _trainable_state(root, full=True)
    if is_main:
        write_adapter_dir(out_dir, peft_state_dict(sd, config), adapter_config(inner, str(config.source_dir or "")))
    if merged:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(root, options=options)  # collective
        if is_main:
            scaling = inner.lora_config.alpha / inner.lora_config.rank
            full = merge_lora({k.removeprefix("model."): v for k, v in full.items()}, scaling)
            save_hf_weights({k: v.to(torch.bfloat16) for k, v in full.items()}, out_dir / "merged", config)
    dist.barrier()
