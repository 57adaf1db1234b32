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

RL-shaped batches (issue 29: the trainer on real RL batches, not fake full rows):

    python benchmarks/rl_trainer.py --shape qwen3-1.7b --seq-len 2048 --rollouts 256 --defaults --with-sft

plays the orchestrator: each step it makes `--rollouts` samples (a `--prompt-len` prompt and a completion of
`--min-completion`..`--max-completion` tokens, random tokens, inference logprobs, one advantage each), packs
them with the orchestrator's own `pack_batch` (first-fit rows of `seq_len`, padded tails, balancing rows) and
sends each rank its TrainingBatch over ZeroMQ, as `rl` does. `--defaults` runs the trainer at its default
settings (no compile / AC / reshard flags from this script: `offload` and `ac` "auto", forwards of
`data.micro_batch_tokens`); `--extra --data.micro-batch-tokens None` gives the row-by-row path to compare.
`perf/throughput` counts real tokens (padding excluded); the JSON line adds `padding_fraction`.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from trainer import SHAPES, make_model_dir  # noqa: E402 - benchmarks/trainer.py, the SFT benchmark

ROOT = Path(__file__).resolve().parents[1]
TRAIN_PY = ROOT / "packages/trainer/src/prime_rl/trainer/rl/train.py"


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def send_rl_batches(args: argparse.Namespace, vocab_size: int) -> list[threading.Thread]:
    """The orchestrator's role: per step, random rollouts packed by the orchestrator's `pack_batch`, one
    TrainingBatch per rank on port + rank (threads; the trainer connects to them)."""
    from prime_rl.common.transport import Sender
    from prime_rl.common.wire import build_training_batch
    from prime_rl.orchestrator.packing import pack_batch
    from prime_rl.orchestrator.rollout import Sample

    rng = np.random.default_rng(0)
    per_step = []
    for _ in range(args.steps):
        samples = []
        for _i in range(args.rollouts):
            n = int(rng.integers(args.min_completion, args.max_completion + 1))
            samples.append(Sample(
                prompt_ids=rng.integers(0, vocab_size, args.prompt_len).tolist(),
                completion_ids=rng.integers(0, vocab_size, n).tolist(),
                completion_logprobs=rng.normal(-np.log(vocab_size), 0.5, n).tolist(),  # random weights: ~log(1/vocab)
                advantage=float(rng.normal()),
            ))  # fmt: skip
        ranks, _ = pack_batch(samples, args.seq_len, args.nproc)
        per_step.append(ranks)

    def serve(rank: int) -> None:
        with Sender(f"tcp://127.0.0.1:{args.port + rank}", bind=True, timeout_s=3600) as sender:
            for step, ranks in enumerate(per_step):
                rows = [dict(input_ids=mb.input_ids, position_ids=mb.position_ids, loss_mask=mb.loss_mask,
                             advantages=mb.advantages, inference_logprobs=mb.inference_logprobs)
                        for mb in ranks[rank]]  # fmt: skip
                sender.send(*build_training_batch(step, step, rows, temperature=1.0))

    threads = [threading.Thread(target=serve, args=(r,), daemon=True) for r in range(args.nproc)]
    for t in threads:
        t.start()
    return threads


def run_rl(args: argparse.Namespace, model_dir: Path) -> dict:
    kind = f"r{args.rollouts}" if args.rollouts else f"g{int(args.generate_samples)}-{args.doc_len}"
    name = f"rl-{args.shape}-s{args.seq_len}-n{args.nproc}-{kind}-d{int(args.defaults)}"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", str(TRAIN_PY),
           "--model.name", str(model_dir), "--data.seq-len", str(args.seq_len), "--max-steps", str(args.steps),
           "--output-dir", str(args.workdir), "--run-name", name]  # fmt: skip
    if not args.defaults:  # the tuned settings of the scaling guide
        cmd += ["--model.compile", "--model.ac", "None", "--no-model.reshard-after-forward"]
    if args.rollouts:
        cmd += ["--data.port", str(args.port)]
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        senders = send_rl_batches(args, vocab)
    else:
        cmd += ["--data.fake", "--data.fake.batch-size", str(args.batch_size or args.nproc)]
        if args.generate_samples:
            cmd += ["--data.fake.generate-samples"]
        if args.doc_len:
            cmd += ["--data.fake.doc-len", str(args.doc_len)]
        senders = []
    cmd += args.extra
    metrics_path = args.workdir / name / "monitors/file/metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for t in senders:
        t.join(timeout=10)
    if proc.returncode != 0:
        return dict(bench="rl_trainer", name=name, error=f"trainer exited {proc.returncode}")
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()][args.warmup :]
    out = dict(
        bench="rl_trainer", shape=args.shape, seq_len=args.seq_len, nproc=args.nproc,
        generate_samples=args.generate_samples, doc_len=args.doc_len, rollouts=args.rollouts,
        defaults=args.defaults, extra=" ".join(args.extra), padding_fraction=_median(rows, "perf/padding_fraction"),
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
    p.add_argument("--rollouts", type=int, default=0, help="RL-shaped batches: samples per step (0: fake rows)")
    p.add_argument("--prompt-len", type=int, default=64, help="with --rollouts: prompt tokens per sample")
    p.add_argument("--min-completion", type=int, default=900, help="with --rollouts: shortest completion")
    p.add_argument("--max-completion", type=int, default=1072, help="with --rollouts: longest completion")
    p.add_argument("--port", type=int, default=29650, help="with --rollouts: first batch port (rank r: + r)")
    p.add_argument("--defaults", action="store_true", help="trainer at default settings (no compile/AC flags)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/prime-rl-bench"))
    p.add_argument(
        "--sft-extra", type=shlex.split, default=[], help='extra sft flags, one string: "--model.offload none"'
    )
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
