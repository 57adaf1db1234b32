import torch

from prime_rl.trainer.rl.loss import LossSettings, rl_loss


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
    loss, stats = rl_loss(p, q, adv, mask, 1.0, LossSettings(token_mask_low=0.125, token_mask_high=8.0))
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
