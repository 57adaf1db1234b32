"""FSDP2: shard each transformer block, then the root (embeddings, final norm, LM head).

Masters stay fp32 and sharded; the MixedPrecisionPolicy all-gathers them as bf16 for compute and
reduces gradients in `reduce_dtype` (fp32 by default: bf16 reductions lose precision across many
ranks). With a 2-D mesh FSDP2 does HSDP: shard within dp_shard, all-reduce across dp_replicate.

With `reshard_after_forward = False` the gathered parameters also stay between the micro-batches of a
step (`reshard_after_backward`): nothing changes the weights until the optimizer steps, so gathering them
again for each micro-batch's forward is the same bytes copied again (on one rank the cast and copies of a
Qwen3-1.7B are ~10 ms a gather; an RL step of 256 rollouts has ~32 forwards of 8k tokens). Every block is
gathered at the end of each forward anyway, so keeping them through the boundary adds nothing to the peak.
With the default (True) they are freed as before: there the boundary is below the peak only when the
activations outweigh the gathered weights, which full AC can reverse.
"""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

KEEP_GATHERED = "_prime_rl_keep_gathered"
"""Attribute `apply_fsdp` sets on the root: True when its parameters stay gathered for a whole step."""


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
    setattr(model, KEEP_GATHERED, not reshard_after_forward)


def reshard_after_backward(model: nn.Module, last: bool) -> None:
    """Before each micro-batch's backward of a step: whether it frees the gathered parameters. With
    `reshard_after_forward = False` only the step's last backward does (the optimizer changes the weights
    next), so the other micro-batches' forwards gather nothing; otherwise every backward frees them."""
    if isinstance(model, FSDPModule) and getattr(model, KEEP_GATHERED, False):
        model.set_reshard_after_backward(last, recurse=True)
