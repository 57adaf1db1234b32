"""The RL loss variants against closed forms on hand-built micro-batches (loss and gradient)."""

import math

import pytest
import torch

from prime_rl.trainer.parallel import ParallelDims
from prime_rl.trainer.rl.data import RLMicroBatch
from prime_rl.trainer.rl.loss import LossSettings, rl_loss
from prime_rl.trainer.rl.train import RLObjective
from prime_rl.trainer.testing import one_rank_group
from prime_rl.trainer.world import World


def _inputs(T=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = -torch.rand(T, generator=g) * 3
    p = (q + 0.05 * torch.randn(T, generator=g)).requires_grad_()
    adv = torch.randn(T, generator=g)
    mask = torch.rand(T, generator=g) > 0.3
    return p, q, adv, mask


def test_gradient_is_importance_weighted_advantage():
    p, q, adv, mask = _inputs()
    scale = float(mask.sum())
    loss, _ = rl_loss(p, q, adv, mask, scale)
    loss.backward()
    expected = torch.where(mask, -torch.exp(p.detach() - q) * adv / scale, torch.zeros_like(adv))
    torch.testing.assert_close(p.grad, expected)


def test_tokens_with_large_gap_are_masked_and_counted():
    p, q, adv, mask = _inputs()
    mask[:] = True
    with torch.no_grad():
        p[0] = q[0] + 3.0  # ratio e^3 > 8
        p[1] = q[1] - 3.0  # ratio e^-3 < 1/8
    loss, stats = rl_loss(p, q, adv, mask, 1.0, LossSettings(mask_low=0.125, mask_high=8.0))
    loss.backward()
    assert p.grad[0] == 0 and p.grad[1] == 0 and (p.grad[2:] != 0).all()
    assert stats["masked_high"] == 1 and stats["masked_low"] == 1 and stats["num_loss_tokens"] == 64


def test_mismatch_kl_is_zero_on_policy_and_positive_off_policy():
    p, q, adv, mask = _inputs()
    _, stats = rl_loss(q.clone().requires_grad_(), q, adv, mask, 1.0)
    assert stats["mismatch_kl"].item() == 0.0
    _, stats = rl_loss(p, q, adv, mask, 1.0)
    assert stats["mismatch_kl"].item() > 0


def test_split_into_micro_batches_gives_the_same_gradient():
    p, q, adv, mask = _inputs(T=96)
    scale = float(mask.sum())
    full, _ = rl_loss(p, q, adv, mask, scale)
    (g_full,) = torch.autograd.grad(full, p)
    parts = sum(
        rl_loss(p[i : i + 32], q[i : i + 32], adv[i : i + 32], mask[i : i + 32], scale)[0] for i in range(0, 96, 32)
    )
    (g_parts,) = torch.autograd.grad(parts, p)
    torch.testing.assert_close(g_full, g_parts)


# A hand-built micro-batch: two packed samples of 3 and 2 loss positions. Positions 0-2 are sample 0,
# 3-5 sample 1 (position 5 is the row's last: no next token, no loss).
LOG_RATIO = [0.1, 0.3, 9.0, -0.2, 0.0, 0.0]  # logp - logq; position 2 is not a loss token (ignored)
MASK = [True, True, False, True, True, False]
SAMPLE = [0, 0, 0, 1, 1, 1]
ADV = [1.0, 1.0, 1.0, -2.0, -2.0, -2.0]


def _hand_batch():
    q = torch.full((6,), -1.0)
    p = (q + torch.tensor(LOG_RATIO)).requires_grad_()
    return p, q, torch.tensor(ADV), torch.tensor(MASK), torch.tensor(SAMPLE)


def test_sequence_ratio_is_gspo_in_closed_form():
    p, q, adv, mask, sample = _hand_batch()
    n = torch.tensor([2.0, 2.0, 2.0, 2.0, 2.0, 2.0])  # loss tokens of each position's sample
    settings = LossSettings(ratio="sequence", mask_low=0.5, mask_high=2.0)
    loss, stats = rl_loss(p, q, adv, mask, 2.0, settings, weights=1.0 / n, sample_ids=sample)  # 2 samples
    s0, s1 = math.exp((0.1 + 0.3) / 2), math.exp((-0.2 + 0.0) / 2)  # geometric means of the token ratios
    assert loss.item() == pytest.approx(-(s0 * 1.0 + s1 * -2.0) / 2, rel=1e-6)  # -mean_i s_i A_i
    loss.backward()
    # d/dlogp_t of -(1/N) s_i A_i = -(1/N) A_i s_i / n_i for the loss tokens of sample i
    expected = [-s0 / 4, -s0 / 4, 0.0, 2 * s1 / 4, 2 * s1 / 4, 0.0]
    torch.testing.assert_close(p.grad, torch.tensor(expected))
    assert stats["masked_low"] == 0 and stats["masked_high"] == 0


def test_sequence_ratio_masks_whole_samples():
    p, q, adv, mask, sample = _hand_batch()
    with torch.no_grad():
        p[3] += 4.0  # sample 1's ratio becomes exp(1.9) > 2: the whole sample is masked, sample 0 is not
    settings = LossSettings(ratio="sequence", mask_low=0.5, mask_high=2.0)
    loss, stats = rl_loss(p, q, adv, mask, 1.0, settings, sample_ids=sample)
    loss.backward()
    assert (p.grad[3:] == 0).all() and (p.grad[:2] != 0).all()
    assert stats["masked_high"] == 2 and stats["masked_low"] == 0


def test_kl_term_k1_and_k3_in_closed_form():
    p, q, adv, mask, _ = _hand_batch()
    ref = p.detach() - torch.tensor([0.5, -0.5, 0.0, 1.0, 0.2, 0.0])  # logp - logref
    for estimator in ("k1", "k3"):
        p.grad = None
        settings = LossSettings(kl_coef=0.1, kl_estimator=estimator)
        loss, stats = rl_loss(p, q, adv, mask, 1.0, settings, ref_logprobs=ref)
        loss.backward()
        d = (p.detach() - ref)[mask]  # log p - log ref on loss tokens
        if estimator == "k1":
            kl, dkl = d, torch.ones_like(d)
        else:  # exp(-d) + d - 1, derivative 1 - exp(-d)
            kl, dkl = torch.exp(-d) + d - 1, 1 - torch.exp(-d)
        pg = -torch.exp(torch.tensor(LOG_RATIO))[mask] * adv[mask]
        assert loss.item() == pytest.approx((pg + 0.1 * kl).sum().item(), rel=1e-6)
        torch.testing.assert_close(p.grad[mask], pg + 0.1 * dkl)
        assert stats["kl_ref"].item() == pytest.approx(kl.sum().item(), rel=1e-6)


class _Policy(torch.nn.Module):
    """A 'model' whose logprobs are its parameters: the objective's normalization shows in the gradient."""

    def __init__(self, logprobs: torch.Tensor):
        super().__init__()
        self.logprobs = torch.nn.Parameter(logprobs.clone())

    def forward(self, input_ids, position_ids, targets, temperature=1.0, seqs=None, token_loss=None):
        entropy = torch.zeros_like(self.logprobs)
        if token_loss is None:
            return self.logprobs, entropy
        # the head's contract (`Transformer.token_outputs`): the loss of the logprobs, which come without gradient
        return token_loss(self.logprobs, 0, self.logprobs.shape[0]), self.logprobs.detach(), entropy


@pytest.fixture(scope="module")
def one_process_group():
    with one_rank_group() as world:
        yield world


@pytest.mark.parametrize("norm", ["token", "sequence", "constant"])
def test_objective_normalizations_in_closed_form(one_process_group, norm):
    """token: sum / loss tokens (3); sequence: mean over the 2 samples of their token means (samples of 2
    and 1 loss tokens, so it differs from token); constant: sum / (2 samples x 8)."""
    _, q, adv, _, _ = _hand_batch()
    mask = torch.tensor([True, True, False, True, False, False])
    mb = RLMicroBatch(
        input_ids=torch.zeros(1, 6, dtype=torch.long),
        position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]),
        targets=torch.zeros(6, dtype=torch.long),
        loss_mask=mask,
        advantages=adv,
        inference_logprobs=q,
        temperature=1.0,
    )
    policy = _Policy(q + torch.tensor(LOG_RATIO))
    objective = RLObjective(
        ParallelDims(1, 1, 1), one_process_group, LossSettings(), norm, 8 if norm == "constant" else None
    )
    stats = objective.forward_backward(policy, [mb])
    per_token = (-torch.exp(torch.tensor(LOG_RATIO)) * adv).masked_fill(~mask, 0.0)
    weight = {
        "token": torch.full((6,), 1 / 3),
        "sequence": torch.tensor([1 / 4, 1 / 4, 1 / 4, 1 / 2, 1 / 2, 1 / 2]),  # 1 / (2 samples x its tokens)
        "constant": torch.full((6,), 1 / (2 * 8)),
    }[norm]
    assert stats["loss/mean"].item() == pytest.approx((per_token * weight).sum().item(), rel=1e-6)
    assert stats["loss/tokens"].item() == 3 and stats["loss/samples"].item() == 2
    torch.testing.assert_close(policy.logprobs.grad, (per_token * weight).float())


def test_objective_with_cp_refuses_to_run_without_the_cp_group():
    """Without the cp group GSPO's ratios of samples cut by a cp slice would silently be per slice."""
    dims = ParallelDims(dp_replicate=1, dp_shard=2, world_size=2, cp=2)
    world = World(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r'cp=2 needs the cp group.*mesh\["cp"\]'):
        RLObjective(dims, world, LossSettings("sequence"))
