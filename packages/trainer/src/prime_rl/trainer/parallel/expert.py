"""Expert parallelism (EP): each of `ep` consecutive ranks owns num_experts / ep experts of every MoE layer.

The MoE module is unchanged: it routes, permutes its tokens into expert order and calls
`mlp.experts(x_sorted, tokens_per_expert)`. EP swaps `mlp.experts` for `ExpertParallelExperts`, which
1) all-to-alls the per-expert counts, then the tokens, to the ranks owning their experts (torch
   all-to-all, `[model.moe.dispatch] type = "torch"`),
2) regroups the received tokens by local expert and runs the grouped GEMM (SwiGLU experts, or
   Nemotron-H's relu^2 experts, which have no gate_proj),
3) all-to-alls the outputs back into the caller's order.

Weights: the stacked `(E, I, H)` expert parameters become DTensors on the `("ep_replicate", "ep")` view of
the world mesh (`ParallelDims.build_mesh`: ep consecutive ranks share one full set of experts),
placements `(Replicate(), Shard(0))`, so names, shapes, `load_hf_weights` (distribute_tensor) and DCP
checkpoints are unchanged. FSDP ignores them (each rank keeps its experts resident: that is the point of
EP). Their gradient is reduced by hand in backward: summed over the ranks that hold the same experts
(ep_replicate) and divided by the world size, the same mean-over-ranks convention FSDP applies to every
other gradient. When the FSDP island is larger than ep this replicates experts across EP groups instead
of also FSDP-sharding them (the torchtitan "dp_shard_mod_ep" layout is left out).

`[model.moe.dispatch] type = "deepep"` replaces the whole MoE forward instead (DeepEP dispatches
routing, not permuted tokens): see `deepep.py`. It keeps these expert parameters and their gradient
convention.

Left out: Mega MoE dispatch (the config is validated, the kernels are not bundled) and token-dropping
capacity limits (dispatch is dropless).
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from prime_rl.common.config.trainer import (
    DeepEPDispatchConfig,
    MegaMoEDispatchConfig,
    MoEConfig,
    MoEDispatchConfig,
    TorchDispatchConfig,
)
from prime_rl.common.dispatch_kernels import dispatch_kernels_error
from prime_rl.kernels.grouped_gemm import grouped_swiglu
from prime_rl.trainer.models.nemotron_h import grouped_relu2
from prime_rl.trainer.parallel.deepep import DeepEPDispatcher, apply_deepep_moe

MAX_AUTO_EP = 8


def resolve_ep(ep: int | str, world_size: int, dp_replicate: int, cp: int, num_experts: int) -> int:
    """The EP degree: "auto" takes the largest d <= 8 dividing the FSDP island and num_experts with
    d % cp == 0 (1 if none, or for a dense model); an explicit value is validated."""
    island = world_size // dp_replicate
    if num_experts == 0:
        return 1  # dense model: EP is a no-op whatever was asked
    if ep == "auto":
        fits = [d for d in range(1, MAX_AUTO_EP + 1) if island % d == 0 and num_experts % d == 0 and d % cp == 0]
        return max(fits, default=1)
    if num_experts % ep:
        choices = ", ".join(str(d) for d in range(1, num_experts + 1) if num_experts % d == 0 and island % d == 0)
        raise ValueError(f"model.ep={ep} must divide num_experts={num_experts}; use one of {choices}")
    if island % ep:
        raise ValueError(f"model.ep={ep} must divide the FSDP island world_size // dp_replicate = {island}")
    return ep


def check_dispatch(moe: MoEConfig, ep: int) -> None:
    """Fail at start-up, naming what is missing, for dispatch backends that cannot run here."""
    dispatch = moe.dispatch
    if isinstance(dispatch, MegaMoEDispatchConfig) and ep < 2:
        raise ValueError(f'[model.moe.dispatch] type = "mega_moe" needs model.ep > 1, got ep={ep}')
    if isinstance(dispatch, DeepEPDispatchConfig):
        if ep < 2:
            raise ValueError(
                f'[model.moe.dispatch] type = "deepep" needs model.ep > 1, got ep={ep}; '
                'set model.ep to 2, 4 or 8 or use type = "torch"'
            )
        if dispatch.num_sms % 2:
            raise ValueError(
                f"[model.moe.dispatch] num_sms={dispatch.num_sms} must be even (DeepEP pairs send and receive "
                f"SMs); use {dispatch.num_sms - 1} or {dispatch.num_sms + 1}"
            )
    error = dispatch_kernels_error(dispatch.type)  # the same line sft / trainer / rl print before torchrun
    if error:
        raise ImportError(error)


class _ReduceExpertGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ep_replicate and divides by the world size."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, group: dist.ProcessGroup | None, world_size: int) -> torch.Tensor:  # noqa: ANN001
        ctx.group, ctx.world_size = group, world_size
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        grad = grad.contiguous()
        if ctx.group is not None:
            dist.all_reduce(grad, group=ctx.group)
        return grad / ctx.world_size, None, None


class ExpertParallelExperts(nn.Module):
    """Drop-in for `Experts`: same parameter names and global shapes, local experts only in memory."""

    def __init__(self, experts: nn.Module, mesh: DeviceMesh):
        super().__init__()
        self.mesh = mesh
        self.ep = mesh["ep"].size()
        self.group = mesh["ep"].get_group()
        self.replicate_group = mesh["ep_replicate"].get_group() if mesh["ep_replicate"].size() > 1 else None
        self.world_size = mesh.size()
        placements = (Replicate(), Shard(0))
        # SwiGLU experts (gate, up, down) or relu^2 experts (up, down): the same all-to-all either way
        self.proj_names = tuple(n for n in ("gate_proj", "up_proj", "down_proj") if hasattr(experts, n))
        for name in self.proj_names:
            full = getattr(experts, name)
            local = full.detach().chunk(self.ep, dim=0)[mesh["ep"].get_local_rank()]
            dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
            self.register_parameter(name, nn.Parameter(dt, requires_grad=full.requires_grad))
        self.num_experts = self.down_proj.shape[0]

    def _local_weight(self, param: nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
        w = _ReduceExpertGrad.apply(param.to_local(), self.replicate_group, self.world_size)
        return w.to(dtype)

    def run_local(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The local experts only: x (M, H) grouped by local expert, counts (E_local,) -> (M, H)."""
        weights = [self._local_weight(getattr(self, n), x.dtype) for n in self.proj_names]
        if len(weights) == 3:
            return grouped_swiglu(x, counts, *weights)
        return grouped_relu2(x, counts, *weights)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x (M, H) sorted by global expert id, tokens_per_expert (E,) -> (M, H) in the same order."""
        ep, num_local = self.ep, self.num_experts // self.ep
        counts = tokens_per_expert.to(torch.int64)
        # out-of-place functional collective: selective AC caches its output (an in-place c10d op would
        # leave the recompute's fresh buffer empty)
        recv_counts = funcol.all_to_all_single(counts, None, None, self.group)  # (ep * E_local,): from rank j
        send_splits = counts.view(ep, num_local).sum(1).tolist()
        recv_counts = recv_counts.view(ep, num_local)
        recv_splits = recv_counts.sum(1).tolist()
        recv = all_to_all_single_autograd(x.contiguous(), recv_splits, send_splits, self.group)  # (M_recv, H)
        # received rows are grouped by source rank, then local expert: regroup by local expert
        expert_of_row = torch.repeat_interleave(
            torch.arange(num_local, device=x.device).repeat(ep), recv_counts.reshape(-1).to(x.device)
        )
        order = torch.argsort(expert_of_row, stable=True)
        y_local = self.run_local(recv[order], recv_counts.sum(0))  # (M_recv, H)
        y_recv = torch.empty_like(y_local).index_copy(0, order, y_local)  # back to arrival order
        return all_to_all_single_autograd(y_recv, send_splits, recv_splits, self.group)


def apply_ep(
    blocks: nn.ModuleList, mesh: DeviceMesh, dispatch: MoEDispatchConfig = TorchDispatchConfig()
) -> list[nn.Parameter]:
    """Swap every MoE layer's experts for their EP version (and, for DeepEP, the MoE forward);
    returns the expert params (FSDP ignores them)."""
    params: list[nn.Parameter] = []
    dispatcher: DeepEPDispatcher | None = None  # one DeepEP buffer for all layers
    for block in blocks:
        experts = getattr(block.mlp, "experts", None)
        if experts is None:
            continue
        num_experts, hidden, _ = experts.down_proj.shape
        if num_experts % mesh["ep"].size():
            raise ValueError(f"ep={mesh['ep'].size()} must divide num_experts={num_experts}")
        ep_experts = ExpertParallelExperts(experts, mesh)
        if isinstance(dispatch, DeepEPDispatchConfig):
            if dispatcher is None:
                dispatcher = DeepEPDispatcher(mesh["ep"].get_group(), mesh.device_type, num_experts, hidden, dispatch)
            apply_deepep_moe(block.mlp, ep_experts, dispatcher)
        else:
            block.mlp.experts = ep_experts
        params.extend(ep_experts.parameters())
    return params
