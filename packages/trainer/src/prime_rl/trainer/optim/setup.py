"""Everything that steps the parameters, built the same way for SFT and RL.

`model.offload` decides the optimizer: "full" runs it on CPU during backward (no gradient clipping,
which needs every gradient at once), otherwise AdamW / SignSGD on the parameters' device, with
"optimizer" moving its state to CPU between steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from prime_rl.common.config.trainer import OptimizerConfig, SchedulerConfig, TrainerModelConfig
from prime_rl.trainer.ckpt import CheckpointManager
from prime_rl.trainer.memory_plan import require_resolved
from prime_rl.trainer.optim.full_offload import FullOffloadOptimizer
from prime_rl.trainer.optim.offload import OptimizerOffload
from prime_rl.trainer.optim.optimizer import build_optimizer, clip_grad_norm, folds_clip
from prime_rl.trainer.optim.scheduler import build_scheduler


@dataclass
class Optimization:
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    offload: OptimizerOffload
    full_offload: bool

    def load_checkpoint(self, ckpt: CheckpointManager, step: int, model: torch.nn.Module) -> None:
        ckpt.load(step, model, self.optimizer, self.scheduler)
        self.offload.offload()

    def save_checkpoint(self, ckpt: CheckpointManager, step: int, model: torch.nn.Module) -> Path:
        self.offload.load()  # DCP reads the state where the parameters live
        path = ckpt.save(step, model, self.optimizer, self.scheduler)
        self.offload.offload()
        return path

    def begin_step(self) -> None:
        """Before forward: the last step's optimizer-state offload must have freed its device memory."""
        self.offload.wait()

    def step(self) -> None:
        """Optimizer step (state brought in and sent back out when offloaded), LR schedule, zero grads."""
        self.offload.load()
        self.optimizer.step()
        if folds_clip(self.optimizer):
            self.optimizer.grad_scale = None  # this step's clip, folded in (clip_grad_norm); never the next one's
        self.offload.offload()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """The global gradient norm, clipping to ``max_norm`` unless the optimizer runs fully offloaded."""
        if self.full_offload:
            return self.optimizer.grad_norm()
        return clip_grad_norm(self.params, max_norm, self.optimizer)


def build_optimization(
    model_cfg: TrainerModelConfig,
    optim_cfg: OptimizerConfig,
    scheduler_cfg: SchedulerConfig,
    max_steps: int,
    model: torch.nn.Module,
    device: torch.device,
    logger: logging.Logger,
) -> Optimization:
    require_resolved(model_cfg, "build_optimization")
    params = [p for p in model.parameters() if p.requires_grad]
    full_offload = model_cfg.offload == "full"
    if full_offload:
        optimizer = FullOffloadOptimizer(params, optim_cfg)
        if optim_cfg.max_norm is not None:
            logger.warning("model.offload='full' disables gradient clipping: optim.max_norm is ignored")
    else:
        optimizer = build_optimizer(optim_cfg, params)
    scheduler = build_scheduler(scheduler_cfg, optimizer, max_steps)
    offload = OptimizerOffload(optimizer, params, device, enabled=model_cfg.offload == "optimizer")
    return Optimization(params, optimizer, scheduler, offload, full_offload)
