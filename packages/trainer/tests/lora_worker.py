"""One rank of the LoRA FSDP2 test (run under torchrun by test_lora_fsdp.py).

Builds the model as `sft` does with `[model.lora]` (FSDP2, full AC, fused LM head, optimizer-state offload),
takes two steps, checkpoints (adapters only), exports the adapter and merged weights, then builds a fresh model
with other random adapters, resumes from the checkpoint and takes step 3 again. Rank 0 saves what the test
compares to `out`.
"""

import logging
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from prime_rl.common.config.trainer import SFTConfig
from prime_rl.common.rundir import RunDir
from prime_rl.trainer.ckpt import CheckpointManager
from prime_rl.trainer.data import build_data_loader
from prime_rl.trainer.lora import export_lora
from prime_rl.trainer.memory_plan import resolve_memory
from prime_rl.trainer.model import build_training_model
from prime_rl.trainer.models import load_arch_config
from prime_rl.trainer.optim.setup import build_optimization
from prime_rl.trainer.parallel import ParallelDims
from prime_rl.trainer.sft.train import train_step
from prime_rl.trainer.world import close_world, exit_rank, init_world


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def main(model_dir: str, out: str, dp_replicate: int) -> None:
    cfg = SFTConfig.model_validate(
        {
            "model": {
                "name": model_dir,
                "dp_replicate": dp_replicate,
                "fused_lm_head_token_chunk_size": 16,
                "lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "o_proj", "up_proj"],
                         "modules_to_save": ["lm_head"]},
            },
            "data": {"type": "fake", "seq_len": 64, "batch_size": 4, "min_sample_len": 8, "max_sample_len": 40},
            "optim": {"type": "adamw", "lr": 1e-2},
        }
    )  # fmt: skip
    world = init_world()
    logger = logging.getLogger("lora_worker")
    dims = ParallelDims.from_world(world.world_size, dp_replicate)
    cfg.model = resolve_memory(cfg.model, cfg.data.seq_len, world.device)  # as sft does
    mesh = dims.build_mesh("cpu")
    loader = build_data_loader(cfg.data, None, load_arch_config(model_dir).vocab_size, world.rank, dims.dp)

    def build(seed: int):  # noqa: ANN202
        torch.manual_seed(seed)
        model = build_training_model(cfg.model, dims, mesh, world.device)
        return model, build_optimization(cfg.model, cfg.optim, cfg.scheduler, 10, model, world.device, logger)

    model, optim = build(0)
    dtypes = {p.requires_grad: str(p.dtype) for p in model.parameters()}  # {False: frozen base, True: trainable}
    stats0 = train_step(model, loader, 0, dims, world)
    norm = optim.grad_norm(cfg.optim.max_norm).item()
    grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    frozen_with_grad = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    optim.step()
    optimizer_state = sorted(
        (n for n, p in model.named_parameters() if p in optim.optimizer.state and optim.optimizer.state[p])
    )
    stats1 = train_step(model, loader, 1, dims, world)
    optim.step()

    run_dir = RunDir(Path(out).parent, "run")
    ckpt = CheckpointManager(run_dir, None, world.is_main)
    path = optim.save_checkpoint(ckpt, 2, model)
    ckpt_bytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    export_lora(model, Path(out).parent / "adapter", world.is_main, merged=True)
    loss2 = train_step(model, loader, 2, dims, world)["loss"]

    fresh, fresh_optim = build(1234)  # other random adapters until the checkpoint is loaded
    fresh_loss2_before = train_step(fresh, loader, 2, dims, world)["loss"]
    fresh_optim.optimizer.zero_grad(set_to_none=True)
    fresh_optim.load_checkpoint(ckpt, 2, fresh)
    resumed_loss2 = train_step(fresh, loader, 2, dims, world)["loss"]
    if world.rank == 0:
        torch.save(
            {
                "loss0": stats0["loss"], "loss1": stats1["loss"], "norm": norm, "grads": grads,
                "frozen_with_grad": frozen_with_grad, "optimizer_state": optimizer_state,
                "ckpt_bytes": ckpt_bytes, "loss2": loss2, "resumed_loss2": resumed_loss2,
                "fresh_loss2_before": fresh_loss2_before, "dtypes": dtypes,
            },
            out,
        )  # fmt: skip
    close_world()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    exit_rank(0)  # a finished rank skips interpreter finalization (see exit_rank)
