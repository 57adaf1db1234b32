"""Activation checkpointing (AC) of transformer blocks, full or selective.

Full AC keeps only each checkpointed block's inputs and recomputes the block in backward. Selective
AC recomputes the cheap element-wise ops but keeps the outputs of the expensive ones: matmuls,
attention kernels, grouped GEMMs and collectives (a collective replayed in backward would also have to
be replayed on every peer). `targets` replaces that default list with operator names ("aten::mm") or
namespaces ("_c10d_functional").

The checkpoint is installed by replacing the block instance's `forward` (non-reentrant
`torch.utils.checkpoint`), not by wrapping the block in another module: parameter names stay those
of the Hugging Face checkpoint, and `compile` / FSDP see the same module objects.
"""

import functools
from collections.abc import Callable

from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from prime_rl.common.config.trainer import ACConfig

DEFAULT_SELECTIVE_TARGETS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::_grouped_mm",
    "prime_rl::grouped_mm",  # the routed experts' Triton grouped GEMM (prime_rl.kernels.grouped_gemm)
    "aten::linear",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
    "_c10d_functional",  # functional (out-of-place) collectives only: a cached in-place one would not refill
)


def selective_policy(targets: tuple[str, ...]) -> Callable:
    """A policy that saves ops whose name or namespace is in `targets`, and recomputes the rest."""
    names = {t for t in targets if "::" in t}
    namespaces = {t for t in targets if "::" not in t}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001 - torch's callback
        schema_name = func._schema.name if hasattr(func, "_schema") else str(func)
        if schema_name in names or getattr(func, "namespace", schema_name.split("::")[0]) in namespaces:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _checkpointed_forward(forward: Callable, context_fn: Callable | None, *args, **kwargs):  # noqa: ANN202
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **extra, **kwargs)


def apply_ac(blocks: nn.ModuleList, cfg: ACConfig) -> int:
    """Checkpoint every `cfg.freq`-th block (blocks freq-1, 2*freq-1, ...); returns how many were wrapped."""
    context_fn = None
    if cfg.mode == "selective":
        policy = selective_policy(tuple(cfg.targets) if cfg.targets is not None else DEFAULT_SELECTIVE_TARGETS)
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    wrapped = 0
    for i, block in enumerate(blocks):
        if (i + 1) % cfg.freq:
            continue
        # bound to the original forward so FSDP / compile that later call `block(...)` go through it
        block.forward = functools.partial(_checkpointed_forward, block.forward, context_fn)
        wrapped += 1
    return wrapped
