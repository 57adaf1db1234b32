"""`model.reshard_after_forward = false`: the gathered parameters stay between the micro-batches of a step (one
gather a step, not one a micro-batch) and are freed after its last backward; the gradients are the same."""

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from prime_rl.trainer.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess  # several processes: the dev-venv suite runs them

MICRO_BATCHES = 3


def _gathered(model: torch.nn.Module) -> bool:
    """FSDP2 registers the sharded DTensor while resharded and the gathered plain tensor while gathered."""
    return not isinstance(model.model.layers[0].mlp.gate_proj.weight, DTensor)


def _one_step(model_dir: str, reshard: bool, nproc: int) -> dict:
    from prime_rl.common.config import load_config
    from prime_rl.common.config.trainer import SFTConfig
    from prime_rl.trainer.data import build_data_loader
    from prime_rl.trainer.memory_plan import resolve_memory
    from prime_rl.trainer.model import build_training_model
    from prime_rl.trainer.models import load_arch_config
    from prime_rl.trainer.parallel import ParallelDims
    from prime_rl.trainer.sft.train import forward_backward
    from prime_rl.trainer.world import init_world

    cfg = load_config(
        SFTConfig,
        ["--model.name", model_dir, "--data.type", "fake", "--data.seq-len", "64",
         "--data.batch-size", str(nproc * MICRO_BATCHES), "--data.micro-batch-size", "1",
         "--model.reshard-after-forward", str(reshard).lower(), "--model.compile", "None"],
    )  # fmt: skip
    world = init_world()
    dims = ParallelDims.from_world(world.world_size, 1)
    loader = build_data_loader(cfg.data, None, load_arch_config(model_dir).vocab_size, world.rank, dims.dp)
    torch.manual_seed(0)
    cfg.model = resolve_memory(cfg.model, cfg.data.seq_len, world.device)
    model = build_training_model(cfg.model, dims, dims.build_mesh("cpu"), world.device)
    micro_batches = loader.micro_batches(0)
    seen: dict[str, bool] = {}
    stats = forward_backward(
        model, micro_batches, dims, world, before_last=lambda: seen.update(before_last=_gathered(model))
    )
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return dict(
        micro_batches=len(micro_batches), before_last=seen["before_last"], after_step=_gathered(model),
        loss=float(stats["loss"]), grads=grads,
    )  # fmt: skip


@pytest.mark.parametrize("nproc", [1, 2])
def test_parameters_stay_gathered_between_micro_batches_with_the_same_gradients(tiny_model_dir: Path, nproc: int):
    default = run_on_ranks(_one_step, nproc, str(tiny_model_dir), True, nproc, timeout=240)[0]
    kept = run_on_ranks(_one_step, nproc, str(tiny_model_dir), False, nproc, timeout=240)[0]
    assert default["micro_batches"] == kept["micro_batches"] == MICRO_BATCHES
    # the default frees them after every backward; reshard_after_forward = false keeps them until the step's end
    assert not default["before_last"] and kept["before_last"]
    assert not default["after_step"] and not kept["after_step"]  # freed once the step is done: the optimizer is next
    assert kept["loss"] == default["loss"]
    for name, grad in default["grads"].items():
        torch.testing.assert_close(kept["grads"][name], grad, rtol=0, atol=0, msg=name)
