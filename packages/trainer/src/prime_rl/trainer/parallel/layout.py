"""Resolve the parallel layout (`ParallelDims`) from the model config, the world size and the model.

All checks here are cheap (no weights, no collectives), so a bad `cp` / `ep` / dispatch choice fails
at start-up with one line naming the value, the rule and the fix.
"""

import dataclasses

from prime_rl.common.config.trainer import ModelConfig
from prime_rl.trainer.models.config import ModelConfig as ArchConfig
from prime_rl.trainer.parallel.context import validate_cp
from prime_rl.trainer.parallel.dims import ParallelDims
from prime_rl.trainer.parallel.expert import check_dispatch, resolve_ep


def resolve_parallel_dims(cfg: ModelConfig, world_size: int, arch: ArchConfig) -> ParallelDims:
    dims = ParallelDims.from_world(world_size, cfg.dp_replicate)
    validate_cp(cfg.cp, world_size, cfg.dp_replicate, arch.num_attention_heads, arch.num_key_value_heads)
    num_experts = arch.num_experts if arch.is_moe else 0
    ep = resolve_ep(cfg.ep, world_size, cfg.dp_replicate, cfg.cp, num_experts)
    if num_experts:
        check_dispatch(cfg.moe, ep)
    return dataclasses.replace(dims, cp=cfg.cp, ep=ep)
