"""FSDP2: shard each transformer block, then the root (embeddings, final norm, LM head).

Masters stay fp32 and sharded; the MixedPrecisionPolicy all-gathers them as bf16 for compute and
reduces gradients in `reduce_dtype` (fp32 by default: bf16 reductions lose precision across many
ranks). With a 2-D mesh FSDP2 does HSDP: shard within dp_shard, all-reduce across dp_replicate.
"""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(
    model: nn.Module,
    blocks: nn.ModuleList,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    ignored_params: set[nn.Parameter] | None = None,
) -> None:
    """`model` is the root module (its forward runs the whole step); `blocks` are sharded one by one.
    `ignored_params` (expert-parallel experts) stay as they are: EP shards and reduces them itself."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kw = {"ignored_params": ignored_params} if ignored_params else {}
    last = len(blocks) - 1
    for i, block in enumerate(blocks):
        # the last block's params are needed again at the start of backward: keep them gathered
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and i < last, **kw)
    # the root's params (embeddings, LM head) are gathered at the first forward and used again by the
    # LM head at the end of forward and start of backward: never reshard them in between
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, **kw)
