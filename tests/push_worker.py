"""A trainer process for test_weight_push.py: the real RL trainer model and a push publisher.

push_worker.py <model_dir> <out> <control> <announce> [nccl|ipc] : publish versions 1 and 2 into the server
    (nccl: gloo on CPU, the default; ipc: shared-memory slots), then save the trainer's own final weights
    (fp32, HF names) to <out>/final for the test to compare.
"""

import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from prime_rl.common.config import load_config
from prime_rl.common.config.rl_trainer import IpcBroadcastConfig, NCCLBroadcastConfig, RLTrainerConfig
from prime_rl.common.net import free_port
from prime_rl.common.rundir import RunDir
from prime_rl.trainer.memory_plan import resolve_memory
from prime_rl.trainer.model import build_training_model
from prime_rl.trainer.models import save_hf_weights
from prime_rl.trainer.parallel import ParallelDims
from prime_rl.trainer.rl.publish import build_publisher
from prime_rl.trainer.world import close_world, exit_rank, init_world


def main(model_dir: str, out: str, control: str, announce: str, transport: str = "nccl") -> None:
    cfg = load_config(RLTrainerConfig, ["--model.name", model_dir, "--data.fake", "--output-dir", out])
    common = dict(dtype="float32", port=free_port(), inference_addresses=[control], announce=announce)
    if transport == "ipc":
        wb = IpcBroadcastConfig(memory="host", bucket_bytes=1 << 20, **common)
    else:
        wb = NCCLBroadcastConfig(**common)
    world = init_world()
    dims = ParallelDims.from_world(world.world_size, 1)
    model_cfg = resolve_memory(cfg.model, cfg.data.seq_len, world.device)  # "auto" as the RL trainer resolves it
    model = build_training_model(model_cfg, dims, dims.build_mesh("cpu"), world.device)
    if transport == "ipc":
        from prime_rl.trainer.rl.publish_ipc import build_ipc_publisher

        publisher = build_ipc_publisher(wb, RunDir(Path(out), "run"), model, world)
    else:
        publisher = build_publisher(wb, RunDir(Path(out), "run"), model, world)
    g = torch.Generator().manual_seed(0 if transport == "nccl" else 1)  # each run moves the served weights
    for version in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.add_(0.05 * torch.randn(local.shape, generator=g))
        blocked = publisher.publish(version)
        print(f"PUBLISHED {version} blocked={blocked:.3f}s", flush=True)
    publisher.close()
    print(f"SERVED background={publisher.last_write_time:.3f}s", flush=True)
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    save_hf_weights({k.removeprefix("model."): v for k, v in sd.items()}, Path(out) / "final", model.config)
    (Path(out) / "final" / "STABLE").touch()
    close_world()


if __name__ == "__main__":
    main(*sys.argv[1:6])
    exit_rank(0)  # a finished rank skips interpreter finalization (see exit_rank)
