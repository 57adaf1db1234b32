"""Filesystem weight publication: time the training loop is blocked vs the background write; prints JSON.

    python benchmarks/weight_publish.py tiny          # the 2-layer test model
    python benchmarks/weight_publish.py 1gib          # a synthetic Qwen3 of ~1 GiB in bf16 (11 layers, hidden 2048)
    python benchmarks/weight_publish.py qwen3-1.7b    # the Qwen3-1.7B shape (3.4 GB in bf16; for a GPU machine)
    python benchmarks/weight_publish.py 1gib --skip-previous   # without the old synchronous writer's timings

One process (FSDP over one rank; on CUDA when available). For each version: ``publish`` (what the loop
waits for: gather + cast on the device + the host copy, asynchronous on CUDA) and the background part
(``last_write_time``: D2H wait, safetensors write + checksums, fsync, rename; pruning runs after the
announcement), next to the previous synchronous implementation (full state dict gathered to CPU, cast
there, ``save_hf_weights``, marker) on the same model.

Then the inference side of the same update, on the published directory (page cache warm, as on one host):
``verify_s`` (``prime_rl.inference.weights.verify.verify_weights_dir``: sizes, checksums, finite values) and
``load_s`` (the worker's file reader ``_iter_safetensors``, each tensor copied into a preallocated tensor on
the device, as a weight loader copies into its parameter; vLLM's own ``load_weights`` bookkeeping is not
included: ``benchmarks/rl_system.py`` logs the server's real figure). ``update_s`` = write + verify + load, the filesystem update's critical path (issue #29: <= 2 s).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for pkg in ("common", "kernels", "trainer", "inference"):
    sys.path.insert(0, str(ROOT / "packages" / pkg / "src"))

SHAPES = {
    "tiny": {},
    "1gib": dict(num_layers=11, hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128),
    "qwen3-1.7b": dict(num_layers=28, hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
}  # fmt: skip


def main(shape: str, versions: int = 3, previous: bool = True) -> dict:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from prime_rl.common.config import load_config
    from prime_rl.common.config.rl_trainer import FilesystemBroadcastConfig, RLTrainerConfig
    from prime_rl.common.rundir import RunDir
    from prime_rl.common.testing import make_tiny_model
    from prime_rl.trainer.memory_plan import resolve_memory
    from prime_rl.trainer.model import build_training_model
    from prime_rl.trainer.models import save_hf_weights
    from prime_rl.trainer.parallel import ParallelDims
    from prime_rl.trainer.rl.publish import build_publisher
    from prime_rl.trainer.world import close_world, init_world

    tmp = Path(tempfile.mkdtemp(prefix="publish-bench-"))
    try:
        model_dir = make_tiny_model(tmp / "model", **SHAPES[shape])
        cfg = load_config(RLTrainerConfig, ["--model.name", str(model_dir), "--data.fake"])
        world = init_world()
        dims = ParallelDims.from_world(world.world_size, 1)
        model_cfg = resolve_memory(cfg.model, cfg.data.seq_len, world.device)  # "auto" as the trainer resolves it
        model = build_training_model(model_cfg, dims, dims.build_mesh(world.device.type), world.device)
        num_bytes = sum(p.numel() for p in model.parameters()) * 2
        publisher = build_publisher(FilesystemBroadcastConfig(keep_last=2), RunDir(tmp, "run"), model, world)
        blocked, background, verify, load = [], [], [], []
        params: dict = {}  # the "engine's parameters" the load copies into, allocated by the first version
        for version in range(1, versions + 1):
            blocked.append(publisher.publish(version))
            publisher.flush()
            background.append(publisher.last_write_time)
            verify_s, load_s = _inference_side(RunDir(tmp, "run").broadcast_dir(version), world.device, params)
            verify.append(verify_s)
            load.append(load_s)
        publisher.close()

        sync = []
        for version in range(versions if previous else 0):
            start = time.perf_counter()
            sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            out = tmp / "sync" / f"step_{version}"
            save_hf_weights({k.removeprefix("model."): v.to(torch.bfloat16) for k, v in sd.items()}, out, model.config)
            (out / "STABLE").touch()
            sync.append(time.perf_counter() - start)
            shutil.rmtree(out)
        close_world()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    update = [w + v + ld for w, v, ld in zip(background, verify, load, strict=True)]
    return {
        "shape": shape,
        "device": str(world.device),
        "published_bytes_bf16": num_bytes,
        "publish_blocked_s": [round(x, 4) for x in blocked],
        "background_write_s": [round(x, 4) for x in background],
        "median_blocked_s": round(statistics.median(blocked), 4),
        "median_background_s": round(statistics.median(background), 4),
        "write_s": round(statistics.median(background), 4),
        "verify_s": round(statistics.median(verify), 4),
        "load_s": round(statistics.median(load), 4),
        "update_s": round(statistics.median(update), 4),
        "update_all_s": [round(x, 4) for x in update],
        "previous_synchronous_s": [round(x, 4) for x in sync],
        "median_previous_synchronous_s": round(statistics.median(sync), 4) if sync else None,
        "host_buffer_bytes": num_bytes,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }


def _inference_side(path: Path, device, params: dict) -> tuple[float, float]:
    """(verify seconds, load seconds) of one published directory, as the inference server reads it."""
    import torch

    from prime_rl.inference.weights.verify import verify_weights_dir
    from prime_rl.inference.worker.extension import _iter_safetensors

    start = time.perf_counter()
    verify_weights_dir(path)
    verified = time.perf_counter()
    for name, tensor in _iter_safetensors(str(path)):
        if name not in params:
            params[name] = torch.empty_like(tensor, device=device)
        params[name].copy_(tensor, non_blocking=True)  # reads the file's pages (safetensors maps them on CPU)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return verified - start, time.perf_counter() - verified


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    print(json.dumps(main(args[0] if args else "tiny", previous="--skip-previous" not in sys.argv)))
