import math

import pytest
import torch

from prime_rl.common.config.trainer import AdamWConfig, ConstantSchedulerConfig, CosineSchedulerConfig, SignSGDConfig
from prime_rl.trainer.optim import SignSGD, build_optimizer, clip_grad_norm
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
