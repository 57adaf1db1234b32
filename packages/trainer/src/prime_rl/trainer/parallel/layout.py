"""Resolve the parallel layout (`ParallelDims`) from the model config, the world size and the model.

All checks here are cheap (no weights, no collectives), so a bad `cp` / `ep` / dispatch choice fails
at start-up with one line naming the value, the rule and the fix.
"""

import dataclasses

from prime_rl.common.config.trainer import TrainerModelConfig
from prime_rl.trainer.models.config import ArchConfig
from prime_rl.trainer.models.moe_compute import check_moe_compute
from prime_rl.trainer.parallel.context import validate_cp
from prime_rl.trainer.parallel.dims import ParallelDims
from prime_rl.trainer.parallel.expert import check_dispatch, resolve_ep


def resolve_parallel_dims(cfg: TrainerModelConfig, world_size: int, arch: ArchConfig) -> ParallelDims:
    dims = ParallelDims.from_world(world_size, cfg.dp_replicate)
    if cfg.cp > 1 and "mamba" in arch.layer_types:
        raise ValueError(
            f"model.cp={cfg.cp}: context parallelism is not implemented for Mamba-2 layers ({arch.model_type}: "
            "the scan would need the previous rank's state); use model.cp=1"
        )
    validate_cp(cfg.cp, world_size, cfg.dp_replicate, arch.num_attention_heads, arch.num_key_value_heads)
    num_experts = arch.num_experts if arch.is_moe else 0
    ep = resolve_ep(cfg.ep, world_size, cfg.dp_replicate, cfg.cp, num_experts)
    if num_experts and arch.model_type == "nemotron_h" and cfg.moe.dispatch.type != "torch":
        # DeepEP / Mega MoE replace the SwiGLU MoE's forward; Nemotron-H's relu^2 MoE has only the torch all-to-all
        raise ValueError(
            f'[model.moe.dispatch] type = "{cfg.moe.dispatch.type}" is not implemented for nemotron_h MoE layers; '
            'use type = "torch"'
        )
    if num_experts:
        check_dispatch(cfg.moe, ep)
        check_moe_compute(cfg.moe.compute)
    return dataclasses.replace(dims, cp=cfg.cp, ep=ep)
