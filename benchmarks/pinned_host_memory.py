"""Host memory the optimizer-state offload pins, against the state's size: `pinned_empty` (exact) vs torch's pinned
allocator (`torch.empty(..., pin_memory=True)`, rounded up to a power of two). Prints one JSON line per method.

    python benchmarks/pinned_host_memory.py [--layers 6]     # on a CUDA machine

Why: the optimizer offload of a Qwen3-8B shape was killed by the host's OOM killer on one H200 with 128 GiB of
RAM (2026-12-05): its 61 GiB of AdamW state lie in buckets of 512 MiB or more, each rounded up to 1-4 GiB.
How: Qwen3-8B's parameter shapes (untied embedding and LM head, `--layers` of the 36 blocks), AdamW state
created by one step on the GPU, then `OptimizerOffload.offload()`: the growth of the process's resident memory
is what its buckets pinned. The same bucket sizes are then allocated with torch's pinned allocator.
"""

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

# by path: the package's __init__ imports the config (pydantic), which the GPU machine has only with the vLLM bundle
_spec = importlib.util.spec_from_file_location(
    "offload", Path(__file__).parents[1] / "packages/trainer/src/prime_rl/trainer/optim/offload.py"
)
_offload = sys.modules["offload"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_offload)
OptimizerOffload = _offload.OptimizerOffload

GiB = 2**30
HIDDEN, INTER, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 4096, 12288, 151936, 32, 8, 128


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def qwen3_8b_shapes(layers: int) -> list[tuple[int, ...]]:
    block = [(HEADS * HEAD_DIM, HIDDEN), (KV_HEADS * HEAD_DIM, HIDDEN), (KV_HEADS * HEAD_DIM, HIDDEN),
             (HIDDEN, HEADS * HEAD_DIM), (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER),
             (HIDDEN,), (HIDDEN,), (HEAD_DIM,), (HEAD_DIM,)]  # fmt: skip
    return [(VOCAB, HIDDEN)] + block * layers + [(HIDDEN,), (VOCAB, HIDDEN)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=6)
    args = p.parse_args()
    device = torch.device("cuda")
    params = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in qwen3_8b_shapes(args.layers)]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    for q in params:
        q.grad = torch.ones_like(q)
    optimizer.step()
    offload = OptimizerOffload(optimizer, params, device, enabled=True)
    state_bytes = sum(8 * q.numel() for q in params)
    before = rss()
    offload.offload()
    offload.wait()
    exact = rss() - before
    sizes = [b.numel * b.host.element_size() for b in offload.buckets]
    print(json.dumps({"bench": "pinned_host_memory", "method": "pinned_empty", "layers": args.layers,
                      "buckets": len(sizes), "state_gib": state_bytes / GiB, "pinned_gib": exact / GiB,
                      "ratio": exact / state_bytes}), flush=True)  # fmt: skip
    before = rss()
    rounded = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
    grown = rss() - before
    print(json.dumps({"bench": "pinned_host_memory", "method": "torch_pin_memory", "layers": args.layers,
                      "buckets": len(rounded), "state_gib": state_bytes / GiB, "pinned_gib": grown / GiB,
                      "ratio": grown / state_bytes}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
