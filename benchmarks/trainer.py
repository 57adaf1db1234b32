"""SFT trainer throughput benchmark: `sft` with fake data on a Qwen-shaped random model; prints JSON.

    python benchmarks/trainer.py --shape qwen3-1.7b --seq-len 8192 --nproc 1 --compile

It writes a random-weight HF model directory (cached), runs the real `sft` entrypoint (torchrun, FSDP2,
fused LM head, bf16 compute over fp32 masters) with `--data.type fake`, then reads the run's
monitors/file/metrics.jsonl and reports the median over the steps after the warmup (compile) steps:
tokens/s (total and per GPU), MFU (dense bf16 peak; 989 TFLOP/s on H100/H200), step time and peak memory.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}  # fmt: skip


def make_model_dir(shape: str, out: Path) -> Path:
    """A Qwen3 config.json + random bf16 safetensors of the given shape (written once)."""
    config = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, max_position_embeddings=40960, hidden_act="silu", attention_bias=False,
                  initializer_range=0.02, torch_dtype="bfloat16", **SHAPES[shape])  # fmt: skip
    return write_model_dir(config, out)


def write_model_dir(config: dict, out: Path) -> Path:
    """An HF config.json + random bf16 safetensors built from `config` (written once; on the GPU if any)."""
    if (out / "model.safetensors").is_file() or (out / "model.safetensors.index.json").is_file():
        return out
    import torch

    from prime_rl.trainer.models import build_model, save_hf_weights

    torch.manual_seed(0)
    model = build_model(config, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
    save_hf_weights(model, out, config)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the trainer runs in a child process: leave it the whole GPU
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--nproc", type=int, default=1, help="GPUs (processes)")
    p.add_argument("--batch-size", type=int, default=None, help="rows per step over all GPUs (default: nproc)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median (compile, allocator)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--fullgraph", action=argparse.BooleanOptionalAction, default=True, help="one graph per block")
    p.add_argument("--attn", default="auto", help="model.attn: auto, sdpa, varlen, flex, ...")
    p.add_argument("--ac", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--chunk", default="8192", help='fused LM head token chunk, or "disabled"')
    p.add_argument("--optim", default="adamw", choices=["adamw", "sign_sgd"])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/prime-rl-bench"))
    p.add_argument("--profile", action="store_true", help="GPU time per kernel category instead (one process)")
    p.add_argument(
        "--extra", nargs=argparse.REMAINDER, default=[], help="more sft flags (last), e.g. --model.offload optimizer"
    )
    args = p.parse_args()

    model_dir = make_model_dir(args.shape, args.workdir / f"{args.shape}-random")
    name = f"{args.shape}-s{args.seq_len}-n{args.nproc}-c{int(args.compile)}-ac{int(args.ac)}-{args.chunk}-{args.attn}"
    batch = args.batch_size or args.nproc
    cmd = [sys.executable, "-m", "prime_rl.trainer.sft.entrypoint", "--model.name", str(model_dir),
           "--data.type", "fake", "--data.seq-len", str(args.seq_len), "--data.batch-size", str(batch),
           "--data.micro-batch-size", "1", "--max-steps", str(args.steps), "--optim.type", args.optim,
           "--model.offload", "none", "--model.ac-offloading", "None", "--model.fused-lm-head-token-chunk-size",
           args.chunk, "--deployment.num-gpus", str(args.nproc), "--output-dir", str(args.workdir),
           "--run-name", name, "--no-ckpt.export-hf", "--no-model.reshard-after-forward", "--model.attn", args.attn]  # fmt: skip
    cmd += ["--model.compile", "--model.compile.fullgraph", str(args.fullgraph).lower()] if args.compile else []
    cmd += [] if args.ac else ["--model.ac", "None"]
    cmd += args.extra
    if args.profile:  # same flags, run through benchmarks/trainer_profile.py's step profiler
        profiler = Path(__file__).with_name("trainer_profile.py")
        sys.exit(subprocess.run([sys.executable, str(profiler), "step", "--", *cmd[3:]]).returncode)
    metrics_path = args.workdir / name / "monitors/file/metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        print(json.dumps(dict(bench="sft", name=name, error=f"sft exited {proc.returncode}")), flush=True)
        sys.exit(proc.returncode)
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()][args.warmup :]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(json.dumps(dict(
        bench="sft", shape=args.shape, seq_len=args.seq_len, nproc=args.nproc, batch_rows=batch,
        compile=args.compile, fullgraph=args.fullgraph, attn=args.attn, ac=args.ac, lm_head_chunk=args.chunk, optim=args.optim, steps_measured=len(rows),
        tokens_per_s=round(med("perf/throughput")), tokens_per_s_per_gpu=round(med("perf/throughput_per_gpu")),
        mfu=round(med("perf/mfu"), 4), step_s=round(med("time/step"), 4),
        peak_mem_gib=round(max(r["perf/peak_memory"] for r in rows), 2),
    )), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
