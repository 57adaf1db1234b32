"""Apply the parallel features to a model in one fixed order (torchtitan style).

Order matters: expert parallel swaps the experts and context parallel rewires attention (module
swaps, so before anything wraps a block), activation checkpointing wraps blocks, compile wraps the
(checkpointed) blocks, and FSDP goes last so its hooks sit outside the compiled regions; FSDP ignores
the expert-parallel experts, which EP keeps resident and reduces itself.
"""

import torch
from torch import nn

from prime_rl.common.config.trainer import TrainerModelConfig
from prime_rl.kernels.grouped_gemm import triton_grouped_enabled
from prime_rl.trainer.parallel.checkpointing import apply_ac
from prime_rl.trainer.parallel.compile import apply_compile, resolve_compile
from prime_rl.trainer.parallel.context import apply_cp
from prime_rl.trainer.parallel.dims import ParallelDims, WorldMesh, fsdp_mesh
from prime_rl.trainer.parallel.expert import apply_ep
from prime_rl.trainer.parallel.fsdp import apply_fsdp
from prime_rl.trainer.parallel.offload import apply_ac_offloading


def parallelize_model(
    root: nn.Module, model: nn.Module, dims: ParallelDims, mesh: WorldMesh, cfg: TrainerModelConfig
) -> None:
    """`root` is the module whose forward runs a whole micro-batch; `model` the transformer inside it
    (`model.layers` are the blocks). `mesh` is `dims.build_mesh(...)`: each feature slices its dims by name."""
    blocks = model.layers
    expert_params: list[nn.Parameter] = []
    if dims.ep_enabled:  # 0. expert parallel: module swap, before AC / compile wrap the blocks
        expert_params = apply_ep(blocks, mesh["ep_replicate", "ep"], cfg.moe.dispatch)
    if dims.cp_enabled:  # 1. context parallel (Ulysses) around each block's attention kernel
        apply_cp(model, mesh["cp"])
    if cfg.ac is not None:  # 2. activation checkpointing wraps blocks; must precede compile
        apply_ac(blocks, cfg.ac)
    if cfg.ac_offloading is not None:  # offload what autograd saves outside the checkpoints
        apply_ac_offloading(root, cfg.ac_offloading.max_inflight_activations)
    compile_cfg = resolve_compile(cfg.compile, mesh.device_type)
    if compile_cfg is not None:  # 3. compile after AC wrapping, before FSDP
        # one graph per MoE block only with the Triton grouped GEMM (CUDA) and no EP dispatch
        moe_is_one_graph = not dims.ep_enabled and triton_grouped_enabled(mesh.device_type)
        apply_compile(blocks, fullgraph=compile_cfg.fullgraph, moe_is_one_graph=moe_is_one_graph)
    apply_fsdp(  # 4. FSDP last
        root,
        blocks,
        fsdp_mesh(mesh, dims),
        param_dtype=torch.bfloat16,
        reduce_dtype=getattr(torch, cfg.reduce_dtype),
        reshard_after_forward=cfg.reshard_after_forward,
        ignored_params=set(expert_params),
    )
