"""The filesystem weight update's parts on a synthetic state dict, without a model or a trainer; prints JSON.

    python benchmarks/weight_update_parts.py 1gib                 # ~1.1 GB bf16, 11 Qwen3-1.7B layers
    python benchmarks/weight_update_parts.py qwen3-1.7b           # 3.4 GB bf16, the Qwen3-1.7B shape
    python benchmarks/weight_update_parts.py 1gib --src /tmp/old  # another tree's packages (before/after)
    python benchmarks/weight_update_parts.py 1gib --rounds 5      # rounds per run (default 3; median printed)

What ``benchmarks/weight_publish.py`` times inside the trainer, isolated so that two trees can be compared
in alternation on a loaded machine: ``write_s`` (``write_hf_dir``: shards written side by side from memory
and their checksums), ``verify_s`` (``verify_weights_dir``: sizes, checksums, finite values), ``load_s``
(the worker's ``_iter_safetensors``, each tensor copied into a preallocated tensor on the device) and
``update_s`` (their sum), and each part's CPU seconds over all threads (``*_cpu_s``: wall time on a shared
machine carries its load, CPU time much less). Each round writes a fresh directory (page cache warm, as on one host). ``--src``
puts that tree's ``packages/*/src`` first on the path (e.g. ``git archive <commit> packages | tar -x -C
/tmp/old``).
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


def _src_root() -> Path:
    if "--src" in sys.argv:
        return Path(sys.argv[sys.argv.index("--src") + 1]).resolve()
    return Path(__file__).resolve().parents[1]


for _pkg in ("common", "kernels", "trainer", "inference"):
    sys.path.insert(0, str(_src_root() / "packages" / _pkg / "src"))

OPTIONS = ("--src", "--rounds")
"""Options that take a value."""
SHAPES = {"1gib": 11, "qwen3-1.7b": 28}
"""Decoder layers of the Qwen3-1.7B shape (hidden 2048, MLP 6144, 16 query / 8 KV heads of 128, vocab 151936)."""


def qwen3_state(num_layers: int) -> dict:
    """bf16 tensors with Qwen3-1.7B's HF names and shapes (tied embeddings), filled with random values."""
    import torch

    h, mlp, q, kv = 2048, 6144, 16 * 128, 8 * 128
    shapes = {"model.embed_tokens.weight": (151936, h), "model.norm.weight": (h,)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (128,), p + "self_attn.k_norm.weight": (128,),
            p + "mlp.gate_proj.weight": (mlp, h), p + "mlp.up_proj.weight": (mlp, h),
            p + "mlp.down_proj.weight": (h, mlp),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        }  # fmt: skip
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g, dtype=torch.float32).bfloat16() for name, shape in shapes.items()}


def main(shape: str, rounds: int = 3) -> dict:
    import torch

    from prime_rl.common.testing import make_tiny_model
    from prime_rl.inference.weights.verify import verify_weights_dir
    from prime_rl.inference.worker.extension import _iter_safetensors
    from prime_rl.trainer.models.config import load_arch_config
    from prime_rl.trainer.weights.files import write_hf_dir

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    state = qwen3_state(SHAPES[shape])
    if device.type == "cuda":  # the trainer writes from a pinned host buffer
        state = {name: t.pin_memory() for name, t in state.items()}
    tmp = Path(tempfile.mkdtemp(prefix="update-parts-"))
    config = load_arch_config(make_tiny_model(tmp / "model"))  # side files only (config.json)
    params: dict = {}
    parts: dict[str, list[float]] = {
        f"{part}{unit}": [] for unit in ("_s", "_cpu_s") for part in ("write", "verify", "load")
    }
    try:
        for r in range(rounds):
            out = tmp / f"step_{r}"
            marks = [(time.perf_counter(), time.process_time())]
            write_hf_dir(state, out, config)
            marks.append((time.perf_counter(), time.process_time()))
            verify_weights_dir(out)
            marks.append((time.perf_counter(), time.process_time()))
            for name, tensor in _iter_safetensors(str(out)):
                if name not in params:
                    params[name] = torch.empty_like(tensor, device=device)
                params[name].copy_(tensor, non_blocking=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            marks.append((time.perf_counter(), time.process_time()))
            for i, part in enumerate(("write", "verify", "load")):
                parts[f"{part}_s"].append(marks[i + 1][0] - marks[i][0])
                # CPU seconds of every thread of the process: steadier than wall time on a shared machine
                parts[f"{part}_cpu_s"].append(marks[i + 1][1] - marks[i][1])
            shutil.rmtree(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    update = [sum(x) for x in zip(parts["write_s"], parts["verify_s"], parts["load_s"], strict=True)]
    return {
        "shape": shape,
        "src": str(_src_root()),
        "device": str(device),
        "bytes": sum(t.numel() * t.element_size() for t in state.values()),
        **{k: round(statistics.median(v), 4) for k, v in parts.items()},
        "update_s": round(statistics.median(update), 4),
        **{f"all_{k}": [round(x, 4) for x in v] for k, v in parts.items()},
        "cpus": os.cpu_count(),
        "load_avg": round(os.getloadavg()[0], 2),
    }


if __name__ == "__main__":
    args = [a for i, a in enumerate(sys.argv[1:], 1) if not a.startswith("--") and sys.argv[i - 1] not in OPTIONS]
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    print(json.dumps(main(args[0] if args else "1gib", rounds)))
