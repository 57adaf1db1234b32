"""Scaling knobs benchmark: the real `sft` entrypoint (fake data) with each knob on / off; prints JSON lines.

    python benchmarks/scaling.py --kind dense --seq-len 8192 --nproc 1

Variants: base (no AC, no AC offloading, offload "none", compile per block with fullgraph=false), then
one knob on at a time: ac=full, ac=selective, ac=full+ac_offloading, offload="optimizer", offload="full",
compile fullgraph=true; with --nproc 2: base (FSDP over 2 GPUs), cp=2, and for the MoE ep=2.
Medians over the steps after `--warmup`: tokens/s (all GPUs), MFU, peak memory (max over ranks).
The dense shape is Qwen3-1.7B (the anchor's shape); the MoE one a small Qwen3-MoE (64 experts, top-8).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SHAPES = {
    "dense": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=2048, intermediate_size=6144,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  tie_word_embeddings=True),
    "moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=1024,
                intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                head_dim=128, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
}  # fmt: skip
PLAIN = ["--model.ac", "None", "--model.ac-offloading", "None", "--model.offload", "none"]


def make_model_dir(kind: str, out: Path) -> Path:
    if (out / "model.safetensors").is_file() or (out / "model.safetensors.index.json").is_file():
        return out
    import torch

    from prime_rl.trainer.models import build_model, save_hf_weights

    config = dict(vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                  hidden_act="silu", attention_bias=False, initializer_range=0.02, torch_dtype="bfloat16",
                  **SHAPES[kind])  # fmt: skip
    torch.manual_seed(0)
    model = build_model(config, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
    save_hf_weights(model, out, config)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def variants(kind: str, nproc: int) -> dict[str, list[str]]:
    if nproc == 2:
        v = {"base": [*PLAIN, "--model.ep", "1"], "cp2": [*PLAIN, "--model.ep", "1", "--model.cp", "2"]}
        if kind == "moe":
            v["ep2"] = [*PLAIN, "--model.ep", "2"]
        return v
    return {
        "base": PLAIN,
        "ac_full": ["--model.ac-offloading", "None", "--model.offload", "none"],
        "ac_selective": ["--model.ac.mode", "selective", "--model.ac-offloading", "None", "--model.offload", "none"],
        "ac_full+offloading": ["--model.offload", "none"],
        "offload_optimizer": ["--model.ac", "None", "--model.ac-offloading", "None", "--model.offload", "optimizer"],
        "compile_fullgraph": [*PLAIN, "--model.compile.fullgraph", "true"],
        "offload_full": ["--model.ac", "None", "--model.ac-offloading", "None", "--model.offload", "full"],  # slowest
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", default="dense", choices=sorted(SHAPES))
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--only", nargs="*", default=None, help="variant names to run")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/prime-rl-bench"))
    args = p.parse_args()
    model_dir = make_model_dir(args.kind, args.workdir / f"scaling-{args.kind}-random")
    for name, flags in variants(args.kind, args.nproc).items():
        if args.only and name not in args.only:
            continue
        run = f"scaling-{args.kind}-n{args.nproc}-{name}"
        cmd = [sys.executable, "-m", "prime_rl.trainer.sft.entrypoint", "--model.name", str(model_dir),
               "--data.type", "fake", "--data.seq-len", str(args.seq_len), "--data.batch-size", str(args.nproc),
               "--max-steps", str(args.steps), "--deployment.num-gpus", str(args.nproc), "--output-dir",
               str(args.workdir), "--run-name", run, "--no-ckpt.export-hf", "--model.compile",
               "--model.compile.fullgraph", "false", *flags]  # fmt: skip
        metrics = args.workdir / run / "monitors/file/metrics.jsonl"
        metrics.unlink(missing_ok=True)
        proc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True)
        if proc.returncode != 0:
            print(json.dumps(dict(kind=args.kind, variant=name, error=(proc.stdout + proc.stderr)[-1500:])), flush=True)
            continue
        rows = [json.loads(line) for line in metrics.read_text().splitlines()][args.warmup :]
        print(json.dumps(dict(
            kind=args.kind, variant=name, nproc=args.nproc, seq_len=args.seq_len, steps_measured=len(rows),
            tokens_per_s=round(statistics.median(r["perf/throughput"] for r in rows)),
            mfu=round(statistics.median(r["perf/mfu"] for r in rows), 4),
            peak_mem_gib=round(max(r["perf/peak_memory"] for r in rows), 2),
        )), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
