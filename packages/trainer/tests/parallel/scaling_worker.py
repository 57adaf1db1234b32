"""One rank of the scaling tests (run under torchrun by test_scaling.py).

Runs several variants in one process group (process start-up dominates on CPU): each builds the model
exactly as `sft` does, with its own config flags, takes one optimizer step on fake packed data and a
second forward/backward, and on rank 0 records the step-0 loss, the full step-0 gradients (absent
under full offload, where they live in CPU accumulators), the gradient norm and the step-1 loss.

argv: out.pt, then a JSON list of {"name", "model_dir", "flags"}.
"""

import json
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
from prime_rl.trainer.optim.full_offload import FullOffloadOptimizer
from prime_rl.trainer.parallel.layout import resolve_parallel_dims
from prime_rl.trainer.sft.train import train_step
from prime_rl.trainer.world import close_world, exit_rank, init_world

BASE = ["--data.type", "fake", "--data.seq-len", "64", "--data.batch-size", "4", "--data.min-sample-len", "8",
        "--data.max-sample-len", "40", "--model.fused-lm-head-token-chunk-size", "16", "--optim.lr", "1e-3",
        "--model.attn", "sdpa"]  # fmt: skip


def run_variant(world, model_dir: str, flags: list[str]) -> dict:
    cfg = load_config(SFTConfig, ["--model.name", model_dir, *BASE, *flags])
    arch = load_arch_config(model_dir)
    dims = resolve_parallel_dims(cfg.model, world.world_size, arch)
    loader = build_data_loader(cfg.data, None, arch.vocab_size, dims.dp_rank(world.rank), dims.dp)
    torch.manual_seed(0)
    cfg.model = resolve_memory(cfg.model, cfg.data.seq_len, world.device)  # as sft does
    model = build_training_model(cfg.model, dims, dims.build_mesh("cpu"), world.device)
    params = list(model.parameters())
    full = cfg.model.offload == "full"
    optimizer = FullOffloadOptimizer(params, cfg.optim) if full else build_optimizer(cfg.optim, params)
    stats0 = train_step(model, loader, 0, dims, world)
    norm = optimizer.grad_norm() if full else clip_grad_norm(params, cfg.optim.max_norm)
    grads = {}
    if not full:
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[name] = g.float().clone()
    optimizer.step()
    optimizer.zero_grad()
    stats1 = train_step(model, loader, 1, dims, world)
    offloader = getattr(model, "activation_offloader", None)
    return {
        "loss0": stats0["loss"],
        "loss1": stats1["loss"],
        "norm": norm.item(),
        "grads": grads,
        "dims": (dims.dp, dims.cp, dims.ep),
        "offloaded": offloader.num_offloaded if offloader is not None else 0,
    }


def main(out: str, variants: list[dict]) -> None:
    world = init_world()
    results = {v["name"]: run_variant(world, v["model_dir"], v["flags"]) for v in variants}
    if world.rank == 0:
        torch.save(results, out)
    close_world()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
    exit_rank(0)  # a finished rank skips interpreter finalization (see exit_rank)
