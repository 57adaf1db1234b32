"""Learning-rate schedules: linear warmup, then constant or cosine decay to `min_lr_ratio`."""

import math

import torch

from prime_rl.common.config.trainer import ConstantSchedulerConfig, CosineSchedulerConfig


def lr_factor(cfg: ConstantSchedulerConfig | CosineSchedulerConfig, step: int, max_steps: int) -> float:
    """Multiplier on the peak lr for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if isinstance(cfg, ConstantSchedulerConfig):
        return 1.0
    decay_steps = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    cfg: ConstantSchedulerConfig | CosineSchedulerConfig, optimizer: torch.optim.Optimizer, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg, step, max_steps))
