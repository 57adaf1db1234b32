"""Router replay: the trainer's MoE routers take the experts inference chose for each token.

MoE RL's known failure: the trainer's router, on slightly different numerics (bf16 kernels, batch shapes, an
FSDP all-gather), picks other experts than vLLM's did for some tokens, and those tokens' logprobs then differ
far more than numerics alone would make them (mismatch_kl grows). slime ("R3") and verl replay inference's
routing: vLLM reports each token's top-k experts per layer (`prime_rl.common.vllm_compat`, "Routed experts"),
the orchestrator packs them beside the tokens (`MicroBatch.routed_experts`), and here each MoE layer's router
uses them in place of its own top-k. The routing weights stay the trainer's: its scores of the replayed experts,
renormalized as usual, so the router still gets a gradient.

Without replay the same data gives the metric: the fraction of tokens whose top-k set differs from
inference's at some layer (`router/expert_mismatch`) and per (token, layer) (`router/expert_mismatch_layer`).

Tokens inference reported nothing for (padding, a sample's last token, a rollout without routed experts) carry
-1 and are routed by the trainer. Left out: Nemotron-H's MoE mixer (its own gate); compiled blocks skip the
mismatch statistics (a Python-state write), as they skip the router's tokens-per-expert.
"""

from __future__ import annotations

import torch
from torch import nn

from prime_rl.trainer.models.config import ArchConfig
from prime_rl.trainer.models.moe import MoE, Router


def moe_routers(model: nn.Module) -> dict[int, Router]:
    """The router of every MoE layer, by layer index (vLLM's routed experts index layers the same way)."""
    return {
        module.layer_idx: module.mlp.router
        for module in model.modules()
        if hasattr(module, "layer_idx") and isinstance(getattr(module, "mlp", None), MoE)
    }


def check_router_replay(config: ArchConfig, name: str) -> None:
    """Raise (one line) for a model router replay cannot apply to: dense, or Nemotron-H's MoE mixer."""
    if config.num_experts == 0:
        raise ValueError(
            f"model.moe.router_replay=true but {name} is a dense model (no experts, nothing to route); remove it "
            "or train a MoE model"
        )
    if config.model_type == "nemotron_h":
        raise ValueError(
            f"model.moe.router_replay=true is not supported for {name}: Nemotron-H's MoE mixer has its own gate; "
            "set router_replay = false"
        )


def set_router_replay(model: nn.Module, routed_experts: torch.Tensor | None, route: bool) -> None:
    """Give every MoE router its layer's slice of ``routed_experts`` (T, layers, k) for the next forward (and its
    recomputation under activation checkpointing); None clears it. ``route``: replay, else only compare."""
    for layer_idx, router in moe_routers(model).items():
        if routed_experts is None:
            router.replay, router.replay_stats = None, None
            continue
        if layer_idx >= routed_experts.shape[1] or routed_experts.shape[2] != router.top_k:
            raise ValueError(
                f"routed experts of shape {tuple(routed_experts.shape)} (tokens, layers, top_k) do not fit MoE layer "
                f"{layer_idx} with top_k={router.top_k}: inference served another model"
            )
        router.replay = routed_experts[:, layer_idx].long()
        router.replay_route = route
        router.replay_stats = None


def replay_mismatch(model: nn.Module, device: torch.device, routed_experts: torch.Tensor | None) -> torch.Tensor:
    """(4,) float64 of the last forward: tokens whose experts differ from inference's at some MoE layer, tokens
    inference reported, (token, layer) pairs that differ, (token, layer) pairs reported. The reported counts come
    from the micro-batch's ``routed_experts``; the differing ones from the routers' comparison, which only eager
    blocks make (a compiled block cannot hand tensors out through module attributes): NaN there, so the metric is
    left out rather than logged as 0. Zeros without routed experts."""
    routers = moe_routers(model)
    if routed_experts is None or not routers:
        return torch.zeros(4, dtype=torch.float64, device=device)
    reported = (routed_experts[:, sorted(routers)] >= 0).all(dim=-1)  # (N, L): inference reported this layer
    stats = [r.replay_stats for r in routers.values()]
    if any(s is None for s in stats):  # compiled blocks: not measured
        differ_tokens = differ_pairs = torch.tensor(float("nan"), device=device)
    else:
        differ = torch.stack([d for d, _ in stats])  # (L, N)
        differ_tokens, differ_pairs = differ.any(0).sum(), differ.sum()
    counts = [differ_tokens, reported.any(dim=-1).sum(), differ_pairs, reported.sum()]
    return torch.stack([c.double().to(device) for c in counts])
