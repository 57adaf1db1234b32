"""DeepEP dispatch for expert parallelism (`[model.moe.dispatch] type = "deepep"`).

The torch path swaps only `mlp.experts` and moves tokens that the MoE already permuted, one copy per
(token, expert). DeepEP's normal-mode (training) kernels work one level up: they take the routing
(x, topk_idx, topk_weights), send each token once to every rank that owns one of its experts, and sum
the per-rank partial outputs back. So here the whole MoE forward is replaced:

    router -> get_dispatch_layout -> dispatch -> local experts (grouped SwiGLU) -> weight -> combine

Design decisions:
- The MoE module keeps its class identity (`isinstance(m, MoE)`), its attributes and its parameter
  names: `apply_deepep_moe` swaps its class for the `ExpertParallelMoE` subclass in place (the way
  FSDP2's `fully_shard` does) and installs the EP experts, so `models/moe.py` stays free of parallel code.
- Routing weights are applied on the expert rank, before combine, because combine sums without weights
  (DeepEP's contract). They travel as DeepEP's float32 `recv_topk_weights`, so the router gradient
  flows back through dispatch's backward (a combine of the weight gradients).
- Backward of dispatch is combine with the same handle, backward of combine is a cached dispatch with
  the handle: both are `torch.autograd.Function`s. Expert weight gradients use the torch path's
  `_ReduceExpertGrad` convention (via `ExpertParallelExperts.run_local`).
- One `deep_ep.Buffer` per EP group, shared by all MoE layers, sized with DeepEP's own dispatch /
  combine config hints for the hidden size; `num_sms` goes to `Buffer.set_num_sms` (even, DeepEP pairs
  send and receive SMs).
- `token_chunk_size` runs dispatch -> experts -> combine per chunk of tokens. Every rank of the EP group
  must run the same number of chunks (each is a collective): the count is agreed with one all-reduce
  (MAX). DeepEP cannot dispatch zero tokens, so a rank left with an empty chunk is an error.
- Synchronous only (no `async_finish` / comm-stream overlap with shared experts): Qwen3-MoE has no
  shared experts to overlap with, and the torch path is synchronous too.

Tested on CPU only, against a test double of the `deep_ep.Buffer` normal-mode API built on gloo
all-to-all (packages/trainer/tests/parallel/deep_ep_double.py): EP=2 with this dispatch matches one
process and EP=2 with torch dispatch in loss and gradients, also with token chunks and selective AC.
The real DeepEP CUDA kernels were not run here. Left out: FP8 dispatch, low-latency mode, overlap.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from prime_rl.common.config.trainer import DeepEPDispatchConfig
from prime_rl.trainer.models.moe import MoE

# local experts: (x_sorted (M, H) grouped by local expert, counts (E_local,)) -> (M, H)
LocalExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_deepep_runtime(device_type: str, backend: str) -> None:
    """DeepEP's kernels are CUDA kernels on NVLink / RDMA buffers, set up over an NCCL process group."""
    if device_type != "cuda" or "nccl" not in backend:
        raise ValueError(
            f'[model.moe.dispatch] type = "deepep" needs CUDA devices and an NCCL process group, got '
            f'device_type={device_type!r} with backend {backend!r}; run on GPUs or use type = "torch"'
        )


@dataclass
class _Handle:
    """What dispatch hands to combine (and both backwards): DeepEP's opaque layout handle."""

    handle: tuple | None = None
    num_recv_tokens_per_expert: list[int] | None = None


class DeepEPDispatcher:
    """One DeepEP buffer for an EP group; `__call__` runs a whole MoE layer's dispatch -> experts -> combine."""

    def __init__(
        self, group: dist.ProcessGroup, device_type: str, num_experts: int, hidden: int, cfg: DeepEPDispatchConfig
    ):
        check_deepep_runtime(device_type, dist.get_backend(group))
        buffer_cls = importlib.import_module("deep_ep").Buffer
        ep = group.size()
        buffer_cls.set_num_sms(cfg.num_sms)  # class-wide in DeepEP; read by the configs below
        try:
            self.dispatch_config = buffer_cls.get_dispatch_config(ep)
            self.combine_config = buffer_cls.get_combine_config(ep)
        except AssertionError as e:  # DeepEP asserts on rank counts it has no tuned config for
            raise ValueError(
                f'[model.moe.dispatch] type = "deepep": DeepEP has no dispatch config for ep={ep} ranks ({e}); '
                'use ep = 2, 4 or 8 (within a node) or type = "torch"'
            ) from e
        hidden_bytes = hidden * 2  # bf16 tokens
        configs = (self.dispatch_config, self.combine_config)
        num_nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden_bytes, ep) for c in configs)
        num_rdma_bytes = max(c.get_rdma_buffer_size_hint(hidden_bytes, ep) for c in configs)
        self.buffer = buffer_cls(group, num_nvl_bytes, num_rdma_bytes)
        self.group = group
        self.num_experts = num_experts
        self.token_chunk_size = cfg.token_chunk_size

    @torch.compiler.disable  # host-synchronizing library calls: opaque to compile, like the torch path's .tolist()
    def __call__(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, local_experts: LocalExperts
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, H) bf16, topk_idx (N, k) int64, topk_weights (N, k) -> (y (N, H), tokens_per_expert (E,))."""
        if x.dtype != torch.bfloat16:
            raise ValueError(
                f'[model.moe.dispatch] type = "deepep" sends bf16 tokens, got {x.dtype}; '
                'train with bf16 parameters or use type = "torch"'
            )
        num_chunks = self._num_chunks(x.shape[0], x.device)
        outputs, counts = [], []
        for xc, ic, wc in zip(
            x.tensor_split(num_chunks),
            topk_idx.tensor_split(num_chunks),
            topk_weights.tensor_split(num_chunks),
            strict=True,
        ):
            y, tokens_per_expert = self._moe_chunk(xc.contiguous(), ic.contiguous(), wc, local_experts)
            outputs.append(y)
            counts.append(tokens_per_expert)
        return torch.cat(outputs) if num_chunks > 1 else outputs[0], torch.stack(counts).sum(0)

    def _num_chunks(self, num_tokens: int, device: torch.device) -> int:
        if self.token_chunk_size is None:
            return 1
        # every chunk is a collective: the whole EP group runs as many as its busiest rank needs
        n = torch.tensor([math.ceil(num_tokens / self.token_chunk_size)], dtype=torch.int64, device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
        num_chunks = int(n.item())
        if num_tokens < num_chunks:
            raise ValueError(
                f"token_chunk_size={self.token_chunk_size}: this rank has {num_tokens} tokens but the EP group "
                f"needs {num_chunks} chunks, and DeepEP cannot dispatch an empty chunk; raise token_chunk_size "
                "or leave it unset"
            )
        return max(num_chunks, 1)

    def _moe_chunk(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, local_experts: LocalExperts
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = (
            self.buffer.get_dispatch_layout(topk_idx, self.num_experts)
        )
        layout = {
            "num_tokens_per_rank": num_tokens_per_rank,
            "num_tokens_per_rdma_rank": num_tokens_per_rdma_rank,
            "is_token_in_rank": is_token_in_rank,
            "num_tokens_per_expert": num_tokens_per_expert,
        }
        state = _Handle()
        # DeepEP takes float32 weights; bf16 -> fp32 is exact, so the expert-side product matches the local path
        recv_x, recv_weights, recv_idx = _Dispatch.apply(x, topk_weights.float(), topk_idx, layout, self, state)
        y_recv = _weighted_local_experts(
            recv_x, recv_idx, recv_weights, state.num_recv_tokens_per_expert, local_experts
        )
        return _Combine.apply(y_recv, self, state), num_tokens_per_expert.to(torch.int64)


def _weighted_local_experts(
    recv_x: torch.Tensor,
    recv_idx: torch.Tensor,
    recv_weights: torch.Tensor,
    num_recv_tokens_per_expert: list[int],
    local_experts: LocalExperts,
) -> torch.Tensor:
    """recv_x (R, H), recv_idx (R, k) local expert or -1 -> (R, H): each row's weighted sum over its local experts."""
    rows, slots = (recv_idx >= 0).nonzero(as_tuple=True)  # (M,) one entry per (received token, local expert)
    order = torch.argsort(recv_idx[rows, slots], stable=True)  # group by local expert
    rows, slots = rows[order], slots[order]
    counts = torch.tensor(num_recv_tokens_per_expert, dtype=torch.int64, device=recv_x.device)  # (E_local,)
    y_sorted = local_experts(recv_x[rows], counts)  # (M, H)
    weighted = y_sorted * recv_weights[rows, slots].to(y_sorted.dtype).unsqueeze(-1)
    return y_sorted.new_zeros(recv_x.shape).index_add_(0, rows, weighted)


class _Dispatch(torch.autograd.Function):
    """Forward: DeepEP dispatch. Backward: combine of the gradients (tokens and routing weights) with the handle."""

    @staticmethod
    def forward(  # noqa: ANN205
        ctx,  # noqa: ANN001
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_idx: torch.Tensor,
        layout: dict[str, Any],
        dispatcher: DeepEPDispatcher,
        state: _Handle,
    ):
        recv_x, recv_idx, recv_weights, num_recv_tokens_per_expert, handle, _ = dispatcher.buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, config=dispatcher.dispatch_config, **layout
        )
        state.handle, state.num_recv_tokens_per_expert = handle, num_recv_tokens_per_expert
        ctx.dispatcher, ctx.handle = dispatcher, handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_weights, recv_idx

    @staticmethod
    def backward(ctx, grad_recv_x: torch.Tensor, grad_recv_weights: torch.Tensor, _grad_idx: None):  # noqa: ANN001, ANN205
        d = ctx.dispatcher
        grad_x, grad_weights, _ = d.buffer.combine(
            grad_recv_x.contiguous(), ctx.handle, topk_weights=grad_recv_weights.contiguous(), config=d.combine_config
        )
        return grad_x, grad_weights, None, None, None, None


class _Combine(torch.autograd.Function):
    """Forward: DeepEP combine (sum over ranks). Backward: cached dispatch of the gradient with the handle."""

    @staticmethod
    def forward(ctx, y_recv: torch.Tensor, dispatcher: DeepEPDispatcher, state: _Handle):  # noqa: ANN001, ANN205
        combined, _, _ = dispatcher.buffer.combine(y_recv.contiguous(), state.handle, config=dispatcher.combine_config)
        ctx.dispatcher, ctx.handle = dispatcher, state.handle
        return combined

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        d = ctx.dispatcher
        grad_recv, *_ = d.buffer.dispatch(grad.contiguous(), handle=ctx.handle, config=d.dispatch_config)
        return grad_recv, None, None


class ExpertParallelMoE(MoE):
    """An MoE whose permute / experts / unpermute run as DeepEP dispatch -> local experts -> combine."""

    dispatcher: DeepEPDispatcher

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, H) -> (N, H); MoE.forward adds the shared experts, if any."""
        topk_weights, topk_idx = self.router(x)
        y, tokens_per_expert = self.dispatcher(x, topk_idx, topk_weights, self.experts.run_local)
        if not torch.compiler.is_compiling():  # as in MoE.forward: no Python-state write in a compiled region
            self.last_tokens_per_expert = tokens_per_expert.detach()
        return y


def apply_deepep_moe(moe: MoE, experts: nn.Module, dispatcher: DeepEPDispatcher) -> None:
    """Turn `moe` into an `ExpertParallelMoE` in place; `experts` is its `ExpertParallelExperts`."""
    moe.experts = experts
    moe.dispatcher = dispatcher
    moe.__class__ = ExpertParallelMoE
