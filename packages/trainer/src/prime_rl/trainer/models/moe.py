"""Mixture-of-experts MLP: softmax top-k router and experts stored as stacked `[E, ...]` weights.

Design:
- Expert weights are three parameters `gate_proj (E, I, H)`, `up_proj (E, I, H)`, `down_proj (E, H, I)`,
  so expert parallelism shards dim 0 and a grouped GEMM consumes them as is. Hugging Face stores
  `experts.{e}.gate_proj.weight`; `weights.py` stacks / unstacks on load / save.
- The forward is route -> permute (group token copies by expert) -> experts -> unpermute. Expert
  parallelism replaces the permute/unpermute pair with an all-to-all dispatch/combine; a grouped
  GEMM runs `Experts.forward` (tokens sorted by expert and per-expert counts).
- Routing matches HF Qwen3-MoE: softmax in fp32 over all experts, top-k, optional renormalization
  (`norm_topk_prob`), weights cast back to the activation dtype. No load-balancing loss (aux-free);
  the last forward's tokens-per-expert count is kept for logging.
- Or HF GLM-4.5 (`router_scoring = "sigmoid"`): fp32 sigmoid scores; experts are chosen on scores +
  `e_score_correction_bias` within the `topk_group` best of `n_group` groups (a group scores by its two
  best experts), weighted by the unbiased scores, renormalized, times `routed_scaling_factor`. The bias
  is a buffer loaded from the checkpoint and kept fixed: pre-training adjusts it for load balance, a
  post-training run has no reason to (and no gradient reaches it).
- Router replay (`[model.moe] router_replay`, RL): the experts inference chose (`Router.replay`, one layer's
  slice of vLLM's routed experts) replace the router's own top-k; the weights are still this router's scores of
  those experts (renormalized and scaled as usual), so the router keeps its gradient. `router_replay.py` sets it.
- Shared experts (`n_shared_experts`, GLM-4.5): one SwiGLU MLP every token goes through, added to the
  routed output; `MoE.routed` is what expert parallelism (DeepEP) replaces.
- The routed experts' GEMMs run in bf16 (`[model.moe.compute]` accepts nothing else that runs; see
  `moe_compute.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prime_rl.kernels.grouped_gemm import grouped_swiglu
from prime_rl.trainer.models.config import ArchConfig
from prime_rl.trainer.models.mlp import MLP


class Router(nn.Module):
    def __init__(self, config: ArchConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.scoring = config.router_scoring
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        if self.scoring == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        self.replay: torch.Tensor | None = None
        """(N, k) int64 experts inference chose for this forward's tokens, -1 rows where it reported none."""
        self.replay_route = False
        """Route by ``replay`` (router replay); False: only compare with it (``replay_stats``)."""
        self.replay_stats: tuple[torch.Tensor, torch.Tensor] | None = None
        """(differ, valid), (N,) bool each, of the last eager forward with ``replay``."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, H) -> topk_weights (N, k) in x.dtype, topk_idx (N, k) int64."""
        if self.scoring == "sigmoid":
            scores, topk_idx = self._sigmoid_group_topk(x)
        else:
            scores = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)  # (N, E)
            topk_idx = torch.topk(scores, self.top_k, dim=-1)[1]
        if self.replay is not None:
            topk_idx = self._replay(topk_idx)
        # the weights of the chosen experts, from this router's scores (replayed or not: gradients reach the router)
        topk_weights = scores.gather(1, topk_idx)
        if self.scoring == "sigmoid":
            if self.norm_topk_prob:
                topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
            return (topk_weights * self.scaling).to(x.dtype), topk_idx
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_weights.to(x.dtype), topk_idx

    def _sigmoid_group_topk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, H) -> fp32 sigmoid scores (N, E) as HF, and the experts chosen on them (N, k)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # (N, E)
        choice = scores + self.e_score_correction_bias.float()
        per_group = self.num_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)  # (N, G)
        group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = keep.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.num_experts)
        return scores, choice.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1, sorted=False)[1]

    def _replay(self, topk_idx: torch.Tensor) -> torch.Tensor:
        """Compare this router's choice with inference's (``replay``, set by ``router_replay.set_router_replay``)
        and, with ``replay_route``, take inference's wherever it reported one (rows of -1: it did not)."""
        replay = self.replay
        if replay.shape != topk_idx.shape:
            raise ValueError(
                f"replayed experts of shape {tuple(replay.shape)} for {tuple(topk_idx.shape)} routing slots: inference's "
                "routed experts must cover the same tokens and top_k as the trainer's forward"
            )
        valid = (replay >= 0).all(dim=-1)  # (N,)
        # the same experts in any order (vLLM's top-k order is its kernel's)
        differ = (topk_idx.sort(dim=-1)[0] != replay.sort(dim=-1)[0]).any(dim=-1) & valid  # (N,)
        if not torch.compiler.is_compiling():  # as MoE.last_tokens_per_expert: compiled blocks skip the stats
            self.replay_stats = (differ.detach(), valid)
        if not self.replay_route:
            return topk_idx
        return torch.where(valid.unsqueeze(-1), replay, topk_idx)


class Experts(nn.Module):
    """SwiGLU experts over tokens already grouped by expert, as one grouped GEMM per projection."""

    def __init__(self, config: ArchConfig):
        super().__init__()
        num_experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x (M, H) sorted by expert, tokens_per_expert (E_local,) -> (M, H)."""
        # Triton grouped GEMM on GPU (no host sync, one op per projection), a per-expert loop elsewhere. Every
        # stacked weight gets a gradient whatever the routing, so FSDP sees the same gradients on every rank.
        return grouped_swiglu(x, tokens_per_expert, self.gate_proj, self.up_proj, self.down_proj)


def permute_tokens(
    x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy each token once per chosen expert, grouped by expert.

    x (N, H), topk_idx (N, k) -> x_sorted (N*k, H), order (N*k,) into the flat (N*k,) routing slots,
    tokens_per_expert (E,).
    """
    flat_idx = topk_idx.reshape(-1)
    order = torch.argsort(flat_idx, stable=True)
    # scatter_add, not bincount: a static (E,) shape keeps torch.compile(fullgraph=True) whole
    tokens_per_expert = flat_idx.new_zeros(num_experts).scatter_add_(0, flat_idx, torch.ones_like(flat_idx))
    return x[order // topk_idx.shape[1]], order, tokens_per_expert


def unpermute_tokens(
    y_sorted: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Weight each expert output by its routing weight and sum the k copies back per token -> (N, H)."""
    top_k = topk_weights.shape[1]
    weighted = y_sorted * topk_weights.reshape(-1)[order].unsqueeze(-1)
    out = y_sorted.new_zeros(num_tokens, y_sorted.shape[-1])
    return out.index_add_(0, order // top_k, weighted)


class MoE(nn.Module):
    def __init__(self, config: ArchConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.router = Router(config)
        self.experts = Experts(config)
        self.shared_experts = (
            MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts
            else None
        )
        self.last_tokens_per_expert: torch.Tensor | None = None  # router stats of the last eager forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, H) -> (N, H)."""
        y = self.routed(x)
        return y if self.shared_experts is None else y + self.shared_experts(x)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum, x (N, H) -> (N, H)."""
        topk_weights, topk_idx = self.router(x)
        x_sorted, order, tokens_per_expert = permute_tokens(x, topk_idx, self.num_experts)
        y_sorted = self.experts(x_sorted, tokens_per_expert)
        if not torch.compiler.is_compiling():  # a Python-state write inside a compiled (or checkpointed
            # and compiled) block is a side effect Dynamo refuses under fullgraph: compiled blocks skip it
            self.last_tokens_per_expert = tokens_per_expert.detach()
        return unpermute_tokens(y_sorted, order, topk_weights, x.shape[0])
