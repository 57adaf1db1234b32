"""One trainer rank for the publication tests (run by test_publish.py under torchrun, or plainly).

publish_worker.py compare <model_dir> <out> <announce|-> : publish v1 and v2 in the background
    while the weights keep changing; rank 0 also writes the synchronous reference (the previous
    implementation: full state dict gathered to CPU, cast there, save_hf_weights) to out/ref_<v>.
publish_worker.py skip <model_dir> <out> <announce|-> : a writer slower than the steps; v1, v2, v3
    published 0.2 s apart: v2 is replaced by v3 before the writer starts it.
publish_worker.py crash <model_dir> <out> <announce|-> : publish v1, then start v2 with a writer
    that stalls halfway through the weight file, print WRITING and wait to be killed.
"""

import sys
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from prime_rl.common.config import load_config
from prime_rl.common.config.rl_trainer import FilesystemBroadcastConfig, RLTrainerConfig
from prime_rl.common.rundir import RunDir
from prime_rl.trainer.memory_plan import resolve_memory
from prime_rl.trainer.model import build_training_model
from prime_rl.trainer.models import save_hf_weights
from prime_rl.trainer.parallel import ParallelDims
from prime_rl.trainer.rl.publish import build_publisher
from prime_rl.trainer.weights import files
from prime_rl.trainer.world import close_world, exit_rank, init_world


def synchronous_reference(model, dtype: torch.dtype, out: Path, is_main: bool) -> None:
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_main:
        save_hf_weights({k.removeprefix("model."): v.to(dtype) for k, v in sd.items()}, out, model.config)


@torch.no_grad()
def perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        local.add_(torch.randn(local.shape, generator=g, dtype=local.dtype) * 0.01)


def main(mode: str, model_dir: str, out: str, announce: str) -> None:
    cfg = load_config(RLTrainerConfig, ["--model.name", model_dir, "--data.fake", "--output-dir", out])
    wb = FilesystemBroadcastConfig(dtype="bfloat16", keep_last=2, announce=None if announce == "-" else announce)
    world = init_world()
    dims = ParallelDims.from_world(world.world_size, 1)
    torch.manual_seed(0)
    model_cfg = resolve_memory(cfg.model, cfg.data.seq_len, world.device)  # "auto" as the RL trainer resolves it
    model = build_training_model(model_cfg, dims, dims.build_mesh("cpu"), world.device)
    run_dir = RunDir(Path(out), "run")
    publisher = build_publisher(wb, run_dir, model, world)
    if mode == "compare":
        for version in (1, 2):
            perturb(model, version)
            synchronous_reference(model, torch.bfloat16, Path(out) / f"ref_{version}", world.is_main)
            blocked = publisher.publish(version)
            perturb(model, 100 + version)  # the next step changes the weights while the write runs
            publisher.flush()  # both versions written (a version staged behind a busy writer may be skipped)
            if world.is_main:
                print(f"PUBLISHED {version} blocked={blocked:.4f}s", flush=True)
        publisher.close()
        if world.is_main:
            print(f"WRITE {publisher.last_write_time:.4f}s", flush=True)
    elif mode == "skip":  # a disk slower than the steps: the loop never waits, the newest version wins
        original = files.write_safetensors

        def slow(path, tensors, metadata=None, **kw):
            time.sleep(1.0)
            return original(path, tensors, metadata, **kw)

        files.write_safetensors = slow
        for version in (1, 2, 3):
            perturb(model, version)
            if version == 3:
                synchronous_reference(model, torch.bfloat16, Path(out) / "ref_3", world.is_main)
            blocked = publisher.publish(version)
            if world.is_main:
                print(f"PUBLISHED {version} blocked={blocked:.4f}s", flush=True)
            time.sleep(0.2)  # the writer has claimed version 1 long before version 2 arrives
        publisher.close()
        if world.is_main:
            print(f"SKIPPED {publisher.skipped}", flush=True)
    elif mode == "crash":
        publisher.publish(1)
        publisher.flush()
        original = files.write_safetensors

        def stalling(path, tensors, metadata=None, **kw):
            half = dict(list(tensors.items())[: max(1, len(tensors) // 2)])
            original(path, half, metadata, **kw)  # a partial file on disk, then the trainer dies
            print("WRITING", flush=True)
            time.sleep(600)

        files.write_safetensors = stalling
        publisher.publish(2)
        time.sleep(600)
    close_world()


if __name__ == "__main__":
    main(*sys.argv[1:5])
    exit_rank(0)  # a finished rank skips interpreter finalization (see exit_rank)
