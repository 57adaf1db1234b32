"""One rank of the FSDP equivalence test (run under torchrun by test_fsdp.py).

Builds the model exactly as `sft` does, runs two optimizer steps on fake packed data, and on rank 0
saves the step-0 loss, the full (gathered) step-0 gradients and the step-1 loss to `out`.
"""

import sys

import torch
from torch.distributed.tensor import DTensor

from prime_rl.common.config import load_config
from prime_rl.common.config.trainer import SFTConfig
from prime_rl.trainer.data import build_data_loader
from prime_rl.trainer.memory_plan import resolve_memory
from prime_rl.trainer.model import build_training_model
from prime_rl.trainer.models import load_arch_config
from prime_rl.trainer.optim import build_optimizer, clip_grad_norm
from prime_rl.trainer.parallel import ParallelDims
from prime_rl.trainer.sft.train import train_step
from prime_rl.trainer.world import close_world, exit_rank, init_world


def main(model_dir: str, out: str, dp_replicate: int, chunk: str) -> None:
    cfg = load_config(
        SFTConfig,
        ["--model.name", model_dir, "--data.type", "fake", "--data.seq-len", "64", "--data.batch-size", "4",
         "--data.min-sample-len", "8", "--data.max-sample-len", "40", "--model.dp-replicate", str(dp_replicate),
         "--model.fused-lm-head-token-chunk-size", chunk, "--optim.lr", "1e-3"],
    )  # fmt: skip
    world = init_world()
    dims = ParallelDims.from_world(world.world_size, dp_replicate)
    vocab = load_arch_config(model_dir).vocab_size
    loader = build_data_loader(cfg.data, None, vocab, world.rank, dims.dp)
    torch.manual_seed(0)
    cfg.model = resolve_memory(cfg.model, cfg.data.seq_len, world.device)  # as sft does
    model = build_training_model(cfg.model, dims, dims.build_mesh("cpu"), world.device)
    params = list(model.parameters())
    optimizer = build_optimizer(cfg.optim, params)
    stats0 = train_step(model, loader, 0, dims, world)
    norm = clip_grad_norm(params, cfg.optim.max_norm)
    grads = {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for name, p in model.named_parameters()
    }
    optimizer.step()
    optimizer.zero_grad()
    stats1 = train_step(model, loader, 1, dims, world)
    if world.rank == 0:
        torch.save({"loss0": stats0["loss"], "loss1": stats1["loss"], "norm": norm.item(), "grads": grads}, out)
    close_world()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
    exit_rank(0)  # a finished rank skips interpreter finalization (see exit_rank)
