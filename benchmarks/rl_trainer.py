"""RL trainer throughput benchmark: the seed's command line on fake data, beside `sft` in the same call.

    python benchmarks/rl_trainer.py --shape qwen3-1.7b --seq-len 8192 --with-sft

runs the real RL entrypoint as the scaling guide writes it

    torchrun --nproc-per-node=1 packages/trainer/src/prime_rl/trainer/rl/train.py --model.name DIR \
        --data.fake --data.seq-len 8192 --data.fake.batch-size 1 --max-steps 10 \
        --model.compile --model.ac None --no-model.reshard-after-forward

(filesystem weight publication every step, as in a real run), reads the run's metrics.jsonl and prints
one JSON line: median tokens/s, MFU, step time (compute, device-synchronized), the time the loop was
blocked publishing weights, the background write time, and wall time per step (step end to step end,
everything included). `--with-sft` first runs `benchmarks/trainer.py` with the same model knobs, so
the ratio RL / SFT comes from one call. Extra trainer flags go after `--extra` (e.g.
`--extra --model.offload none`); `--sft-extra "--model.offload optimizer"` passes flags to `sft` only.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from trainer import SHAPES, make_model_dir  # noqa: E402 - benchmarks/trainer.py, the SFT benchmark

ROOT = Path(__file__).resolve().parents[1]
TRAIN_PY = ROOT / "packages/trainer/src/prime_rl/trainer/rl/train.py"


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def run_rl(args: argparse.Namespace, model_dir: Path) -> dict:
    name = f"rl-{args.shape}-s{args.seq_len}-n{args.nproc}-g{int(args.generate_samples)}-{args.doc_len}"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", str(TRAIN_PY),
           "--model.name", str(model_dir), "--data.fake", "--data.seq-len", str(args.seq_len),
           "--data.fake.batch-size", str(args.batch_size or args.nproc), "--max-steps", str(args.steps),
           "--model.compile", "--model.ac", "None", "--no-model.reshard-after-forward",
           "--output-dir", str(args.workdir), "--run-name", name]  # fmt: skip
    if args.generate_samples:
        cmd += ["--data.fake.generate-samples"]
    if args.doc_len:
        cmd += ["--data.fake.doc-len", str(args.doc_len)]
    cmd += args.extra
    metrics_path = args.workdir / name / "monitors/file/metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        return dict(bench="rl_trainer", name=name, error=f"trainer exited {proc.returncode}")
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()][args.warmup :]
    out = dict(
        bench="rl_trainer", shape=args.shape, seq_len=args.seq_len, nproc=args.nproc,
        generate_samples=args.generate_samples, doc_len=args.doc_len, extra=" ".join(args.extra),
        steps_measured=len(rows), tokens_per_s=round(_median(rows, "perf/throughput")),
        mfu=round(_median(rows, "perf/mfu"), 4), step_s=round(_median(rows, "time/step"), 4),
        publish_blocked_s=_median(rows, "time/publish_weights"), publish_write_s=_median(rows, "time/publish_write"),
        wall_s=_median(rows, "time/wall"), peak_mem_gib=round(max(r["perf/peak_memory"] for r in rows), 2),
    )  # fmt: skip
    if out["wall_s"]:
        out["wall_over_step"] = round(out["wall_s"] / out["step_s"], 3)
    return out


def run_sft(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).with_name("trainer.py")), "--shape", args.shape, "--seq-len",
           str(args.seq_len), "--nproc", str(args.nproc), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--workdir", str(args.workdir)]  # fmt: skip
    if args.generate_samples:  # the same packing: fake SFT samples of doc_len tokens (or random lengths)
        lo = args.doc_len or 2
        hi = args.doc_len or args.seq_len // 2
        cmd += ["--extra", "--data.min-sample-len", str(lo), "--data.max-sample-len", str(hi), *args.sft_extra]
    elif args.sft_extra:
        cmd += ["--extra", *args.sft_extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(proc.stderr[-4000:])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else dict(bench="sft", error=f"exited {proc.returncode}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=None, help="rows per step over all GPUs (default: nproc)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the medians (compile, allocator)")
    p.add_argument("--generate-samples", action="store_true", help="pack random-length samples into each row")
    p.add_argument("--doc-len", type=int, default=None, help="with --generate-samples: tokens per sample")
    p.add_argument("--with-sft", action="store_true", help="run benchmarks/trainer.py first, same knobs")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/prime-rl-bench"))
    p.add_argument("--sft-extra", type=shlex.split, default=[], help='extra sft flags, one string: "--model.offload none"')
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="extra RL trainer flags (last)")
    args = p.parse_args()

    model_dir = make_model_dir(args.shape, args.workdir / f"{args.shape}-random")
    sft = run_sft(args) if args.with_sft else None
    if sft is not None:
        print(json.dumps(sft), flush=True)
    rl = run_rl(args, model_dir)
    if sft is not None and "tokens_per_s" in sft and "tokens_per_s" in rl:
        rl["vs_sft"] = round(rl["tokens_per_s"] / sft["tokens_per_s"], 3)
    print(json.dumps(rl), flush=True)


if __name__ == "__main__":
    main()
