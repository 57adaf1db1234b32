"""One rank of the LoRA KL-reference test (run under torchrun by test_lora_kl.py).

The RL objective with a KL term, once against a frozen copy of the initial weights (what the trainer builds
without LoRA) and once against the policy with its adapters off (`BaseModelView`, what it uses with LoRA), on
the same FSDP2 policy whose adapters moved off B = 0. Rank 0 saves both steps' statistics and gradients.
"""

import sys

import torch
from torch.distributed.tensor import DTensor

from prime_rl.common.config.rl_trainer import FakeRLDataConfig
from prime_rl.common.config.trainer import TrainerModelConfig
from prime_rl.trainer.loop import to_host
from prime_rl.trainer.lora import BaseModelView, lora_modules, set_full
from prime_rl.trainer.memory_plan import resolve_memory
from prime_rl.trainer.model import build_training_model
from prime_rl.trainer.models import load_arch_config
from prime_rl.trainer.parallel import ParallelDims
from prime_rl.trainer.rl.data import FakeSource
from prime_rl.trainer.rl.loss import LossSettings
from prime_rl.trainer.rl.train import RLObjective
from prime_rl.trainer.world import close_world, exit_rank, init_world


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def main(model_dir: str, out: str) -> None:
    world = init_world()
    dims = ParallelDims.from_world(world.world_size, 1)
    mesh = dims.build_mesh("cpu")
    cfg = TrainerModelConfig(
        name=model_dir, fused_lm_head_token_chunk_size=16, lora={"rank": 4, "target_modules": ["q_proj", "down_proj"]}
    )
    cfg = resolve_memory(cfg, 64, world.device)  # as the RL trainer does
    torch.manual_seed(0)
    policy = build_training_model(cfg, dims, mesh, world.device)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a trained policy: adapters off B = 0, so KL to the base is not 0
        for module in lora_modules(policy).values():
            set_full(module.lora_B, torch.randn(tuple(module.lora_B.shape), generator=gen) * 0.05)
    copy = build_training_model(cfg, dims, mesh, world.device).requires_grad_(False)  # B = 0: the base
    fake = FakeRLDataConfig(batch_size=2, generate_samples=True, doc_len=24)
    batches = FakeSource(fake, 64, load_arch_config(model_dir).vocab_size, dims.dp_rank(world.rank), dims.dp).get(0)
    settings = LossSettings(kl_coef=0.5)
    results = {}
    for name, ref in (("copy", copy), ("view", BaseModelView(policy))):
        stats = to_host(RLObjective(dims, world, settings, ref_model=ref).forward_backward(policy, batches))
        grads = {n: _full(p.grad) for n, p in policy.named_parameters() if p.grad is not None}
        policy.zero_grad(set_to_none=True)
        results[name] = {
            "stats": stats,
            "grads": grads,
            "scaling": lora_modules(policy)["model.layers.0.mlp.down_proj"].scaling,
        }
    if world.rank == 0:
        torch.save(results, out)
    close_world()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_rank(0)  # a finished rank skips interpreter finalization (see exit_rank)
