"""Apply the parallel features to a model in one fixed order (torchtitan style).

Order matters: context parallel (later) rewires attention, activation checkpointing (later) wraps
blocks, compile wraps the (checkpointed) blocks, and FSDP goes last so its hooks sit outside the
compiled regions.
"""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from prime_rl.common.config.trainer import ModelConfig
from prime_rl.trainer.parallel.compile import apply_compile
from prime_rl.trainer.parallel.dims import ParallelDims, fsdp_mesh
from prime_rl.trainer.parallel.fsdp import apply_fsdp


def parallelize_model(
    root: nn.Module, blocks: nn.ModuleList, dims: ParallelDims, mesh: DeviceMesh, cfg: ModelConfig
) -> None:
    """`root` is the module whose forward runs a whole micro-batch; `blocks` its transformer layers."""
    # 1. context parallel: later issue
    # 2. activation checkpointing: later issue (wraps blocks; must precede compile)
    if cfg.compile is not None:  # 3. compile after AC wrapping, before FSDP
        apply_compile(blocks, fullgraph=cfg.compile.fullgraph)
    apply_fsdp(  # 4. FSDP last
        root,
        blocks,
        fsdp_mesh(mesh, dims),
        param_dtype=torch.bfloat16,
        reduce_dtype=getattr(torch, cfg.reduce_dtype),
        reshard_after_forward=cfg.reshard_after_forward,
    )
