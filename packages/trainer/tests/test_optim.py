import math

import pytest
import torch

from prime_rl.common.config.trainer import AdamWConfig, ConstantSchedulerConfig, CosineSchedulerConfig, SignSGDConfig
from prime_rl.trainer.optim import SignSGD, build_optimizer, clip_grad_norm
from prime_rl.trainer.optim.optimizer import folds_clip
from prime_rl.trainer.optim.scheduler import lr_factor


def test_sign_sgd_step_and_weight_decay():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    p.grad = torch.tensor([0.5, -4.0, 0.0])
    SignSGD([p], lr=0.1, weight_decay=0.5).step()
    expected = torch.tensor([1.0, -2.0, 3.0]) * (1 - 0.05) - 0.1 * torch.tensor([1.0, -1.0, 0.0])
    assert torch.allclose(p.detach(), expected)


def test_build_optimizer_types():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert isinstance(build_optimizer(AdamWConfig(), p), torch.optim.AdamW)
    assert isinstance(build_optimizer(SignSGDConfig(), p), SignSGD)


def test_clip_grad_norm():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    assert clip_grad_norm([p], 1.0).item() == pytest.approx(5.0)
    assert p.grad.norm().item() == pytest.approx(1.0, rel=1e-5)


def test_schedules():
    const = ConstantSchedulerConfig(warmup_steps=4)
    assert [lr_factor(const, s, 10) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cos = CosineSchedulerConfig(warmup_steps=2, min_lr_ratio=0.1)
    assert lr_factor(cos, 2, 12) == pytest.approx(1.0)
    assert lr_factor(cos, 7, 12) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(cos, 12, 12) == pytest.approx(0.1)


def _train_three_steps(fused: bool, fold: bool, max_norm: float | None, fsdp: bool) -> list[torch.Tensor]:
    """Three AdamW steps of a tiny MLP with large gradients; the clip folded into the step or done in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    if fsdp:
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-2, fused=fused, foreach=not fused)
    norms = []
    for step in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).sum().mul(100).backward()
        norms.append(clip_grad_norm(params, max_norm, optimizer if fold else None))
        optimizer.step()
        if folds_clip(optimizer):
            optimizer.grad_scale = None
        optimizer.zero_grad()
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]
    return [t.detach().clone() for t in full] + [torch.stack(norms)]


@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp"])
@pytest.mark.parametrize("max_norm", [1.0, 1e9, None], ids=["clips", "below", "off"])
def test_a_clip_folded_into_fused_adamw_updates_as_the_in_place_clip(max_norm, fsdp):
    """Fused AdamW takes the clip as its grad_scale (no pass of its own over the gradients): the weights after
    three steps and the reported norms match clipping in place, whether the clip bites, does not, or is off."""
    from prime_rl.trainer.testing import one_rank_group

    assert folds_clip(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True))
    assert not folds_clip(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], foreach=True))
    if fsdp:
        with one_rank_group():
            folded, in_place = (_train_three_steps(True, fold, max_norm, fsdp) for fold in (True, False))
    else:
        folded, in_place = (_train_three_steps(True, fold, max_norm, fsdp) for fold in (True, False))
        reference = _train_three_steps(False, False, max_norm, fsdp)  # foreach AdamW, clipped in place
        for a, b in zip(in_place, reference):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(folded, in_place):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert folded[-1].min() > 1.0  # the gradients are large: with max_norm 1 the clip bites every step
    if max_norm == 1.0:  # and it matters: unclipped, the weights end elsewhere
        unclipped = _train_three_steps(True, True, None, fsdp=False)
        assert not torch.allclose(folded[0], unclipped[0], rtol=1e-3)
