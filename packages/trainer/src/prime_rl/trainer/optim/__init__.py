"""Optimizers (AdamW, SignSGD), learning-rate schedules and optimizer-state CPU offload."""

from prime_rl.trainer.optim.offload import OptimizerOffload
from prime_rl.trainer.optim.optimizer import SignSGD, build_optimizer, clip_grad_norm
from prime_rl.trainer.optim.scheduler import build_scheduler

__all__ = ["OptimizerOffload", "SignSGD", "build_optimizer", "build_scheduler", "clip_grad_norm"]
