"""The whole RL step on one GPU: `rl` itself (vLLM, orchestrator, trainer) at default trainer settings, beside
vLLM's own generation rate on the same GPU share, prompts and sampling settings, in the same call.

    python benchmarks/rl_system.py --shape qwen3-1.7b --steps 5 --max-tokens 1024

1. Model: a Qwen3 of the given shape with random bf16 weights and the tiny test tokenizer (its ids padded to
   the shape's 151,936), so rollouts run to `max_tokens` almost always (EOS is one id in 151,936).
2. vLLM alone (`--baseline`): offline `LLM.generate` in a fresh process with the run's `gpu_memory_utilization`
   and `max_model_len`, the arithmetic environment's prompts rendered by the chat template, `n = group_size`,
   `logprobs = 0` and the run's temperature: generated tokens / seconds over a second, timed call.
3. `rl` on one GPU (`num_infer_gpus = 0`: inference shares the trainer's GPU), synchronous by default, for
   `--steps` steps; everything else at its default unless `--extra` says otherwise, but for
   `filter_zero_advantage = false`: random weights score 0 on every task, and the trainer must still train
   on the whole batch (zero advantages cost the same compute as any others). Per step it reads
   metrics.jsonl (trainer and orchestrator rows) and the inference log's weight loads:
   rollout = the orchestrator collecting the step's groups, train = the trainer's step (forward, backward,
   optimizer), publish = the loop blocked publishing (+ the background write), load = inference paused
   loading (+ verifying while serving), wall = step end to step end; gpu_busy = (rollout + train + load) /
   wall, an upper bound when rollouts overlap training (`--off-policy 1`), an exact share when synchronous;
   beyond_rollout_train = wall - rollout - train (what the hand-over, publish and load add to a synchronous
   step). On a machine with `nvidia-smi`, `gpu_timeline.py` samples the GPU while `rl` runs: `<name>.svg` in
   the workdir (memory per device and process, utilization, a mark as each trainer step ends) and
   `gpu_busy_sampled`, the share of samples with a kernel running per device over the timed steps.

4. `--colocated yes` runs `[deployment] type = "colocated"` instead (inference sleeps while the trainer steps,
   vLLM's share sized by the launcher unless `--gpu-memory-utilization` is given); `--colocated both` runs the
   split mode then the colocated one, same shape, in the same call. Per step it adds what the hand-over moved:
   sleep, wake of the weights, load, wake of the KV cache, how long inference slept (`colocate/*`), the
   trainer's `time/release`, and its allocated / reserved GiB at each phase (`memory/*`: at the batch, the
   step's peak, before and after the release) for a memory timeline. A colocated run pushes through ipc (rl's
   default there: no wake of the weights or load on the orchestrator's side, `publish_s` holds the wake and
   the push); `--transport filesystem ipc` runs each mode once per transport, to compare them.

Prints one JSON line per step and a summary line per mode last (rollout tok/s against vLLM's, trainer tok/s, MFU).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_timeline import GpuTimeline, busy_fraction, read_samples, render_svg  # noqa: E402
from trainer import make_model_dir  # noqa: E402 - benchmarks/trainer.py: random bf16 weights of a shape

from prime_rl.common.vllm_compat import engine_env_defaults  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOAD_LINE = re.compile(r"loaded weights version (\d+) from .*: verify ([0-9.]+) s, load ([0-9.]+) s")
PUSH_LINE = re.compile(r"received weights version (\d+) pushed by the trainer: (\[.*\])(?:; engine (\{.*\}))?")
"""A pushed version's worker statistics (`prime_rl.inference.worker.broadcast.load_buckets`), one dict a worker."""


def parse_pushes(text: str) -> dict[int, list[dict]]:
    """Each pushed version's worker statistics from an inference log, the first worker's with the engine's steps
    around the load (`engine`: pause, workers, reset_cache, label, resume, awaited; `weights.apply`)."""
    pushes = {}
    for m in PUSH_LINE.finditer(text):
        try:
            workers = ast.literal_eval(m.group(2))
            if m.group(3) and workers:
                workers[0] = {**workers[0], "engine": ast.literal_eval(m.group(3))}
            pushes[int(m.group(1))] = workers
        except (SyntaxError, ValueError):  # a line cut short: the split is missing, not the run
            pass
    return pushes


BASELINE = r"""
import json, sys, time


def main():
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    model, util, max_len, n, temperature, max_tokens, prompts_file = sys.argv[1:8]
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for p in json.load(open(prompts_file))]
    llm = LLM(model=model, gpu_memory_utilization=float(util), max_model_len=int(max_len), dtype="bfloat16",
              logprobs_mode="processed_logprobs")
    params = SamplingParams(n=int(n), temperature=float(temperature), max_tokens=int(max_tokens), logprobs=0,
                            top_p=1.0, top_k=-1, min_p=0.0)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up: CUDA graphs, allocator
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    print("BASELINE " + json.dumps(dict(tokens=tokens, seconds=elapsed, tokens_per_s=tokens / elapsed)), flush=True)


if __name__ == "__main__":  # vLLM starts its engine in a new process that re-imports this file
    main()
"""


def note(message: str) -> None:
    """Progress on stderr (the JSON results stay alone on stdout)."""
    print(f"[rl_system {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build_model(shape: str, workdir: Path) -> Path:
    """Random weights of ``shape`` plus the tiny tokenizer (ids 0 <|endoftext|>, 2 <|im_end|>)."""
    from prime_rl.common.testing import make_tiny_model

    model_dir = make_model_dir(shape, workdir / f"{shape}-random")
    tok = make_tiny_model(workdir / "tokenizer-donor", num_layers=1, hidden_size=64)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(tok / name, model_dir / name)
    config = json.loads((model_dir / "config.json").read_text())
    donor = json.loads((tok / "config.json").read_text())
    config.update(bos_token_id=donor["bos_token_id"], eos_token_id=donor["eos_token_id"])
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return model_dir


def arithmetic_prompts(count: int) -> list[str]:
    """The arithmetic environment's task texts, as the orchestrator sends them."""
    import numpy as np

    from prime_rl.orchestrator.envs.arithmetic import ArithmeticEnv

    env = ArithmeticEnv()
    return [env.build_prompt(task)[-1]["content"] for task in env.sample_tasks(count, np.random.default_rng(0))]


def run_baseline(args: argparse.Namespace, model_dir: Path) -> dict:
    prompts_file = args.workdir / "prompts.json"
    prompts_file.write_text(json.dumps(arithmetic_prompts(args.rollouts // args.group_size)))
    script = args.workdir / "vllm_alone.py"
    script.write_text(BASELINE)
    cmd = [sys.executable, str(script), str(model_dir), str(args.gpu_memory_utilization), str(args.seq_len),
           str(args.group_size), str(args.temperature), str(args.max_tokens), str(prompts_file)]  # fmt: skip
    env = {**engine_env_defaults(importlib.util.find_spec("flashinfer") is not None), **os.environ}
    log = args.workdir / "vllm_alone.log"
    with open(log, "w") as f:
        try:
            out = subprocess.run(
                cmd, stdout=subprocess.PIPE, stderr=f, text=True, env=env, timeout=args.baseline_timeout
            )
        except subprocess.TimeoutExpired:
            return dict(error=f"vLLM alone took over {args.baseline_timeout} s; see {log}")
    for line in out.stdout.splitlines():
        if line.startswith("BASELINE "):
            return json.loads(line.removeprefix("BASELINE "))
    return dict(error=f"baseline exited {out.returncode}; see {log}")


SPLIT_SHARE = 0.35
"""vLLM's share in split mode on one GPU (both sides keep their memory), unless --gpu-memory-utilization."""


def rl_config(args: argparse.Namespace, model_dir: Path, colocated: bool, name: str, transport: str | None) -> Path:
    path = args.workdir / f"{name}.toml"
    # None: rl's default for the mode (split: filesystem, colocated: ipc)
    weight_broadcast = f'[weight_broadcast]\ntype = "{transport}"' if transport else ""
    if colocated:
        deployment = 'type = "colocated"\nnum_gpus = 1'
        share = args.gpu_memory_utilization  # None: the launcher sizes it beside the resting trainer
    else:
        deployment = "num_train_gpus = 1\nnum_infer_gpus = 0"
        share = args.gpu_memory_utilization or SPLIT_SHARE
    share_line = f"gpu_memory_utilization = {share}" if share is not None else ""
    path.write_text(f"""
output_dir = "{args.workdir / "runs"}"
max_steps = {args.steps}
seq_len = {args.seq_len}
[run]
name = "{name}"
[model]
name = "{model_dir}"
[deployment]
{deployment}
{weight_broadcast}
[orchestrator]
batch_size = {args.rollouts}
group_size = {args.group_size}
max_off_policy_steps = {args.off_policy}
[orchestrator.advantage]
filter_zero_advantage = false
[orchestrator.sampling]
temperature = {args.temperature}
max_tokens = {args.max_tokens}
[orchestrator.env]
type = "arithmetic"
[inference.vllm]
max_model_len = {args.seq_len}
{share_line}
dtype = "bfloat16"
""")
    return path


COLOCATE_KEYS = {
    "sleep_s": "colocate/sleep_s", "wake_weights_s": "colocate/wake_weights_s", "colocate_load_s": "colocate/load_s",
    "wake_kv_s": "colocate/wake_kv_s", "asleep_s": "colocate/asleep_s", "release_s": "time/release",
}  # fmt: skip
"""Per-step fields of a colocated run -> its metrics keys (orchestrator's hand-over, trainer's release)."""


def run_rl(
    args: argparse.Namespace, model_dir: Path, colocated: bool = False, transport: str | None = None
) -> tuple[list[dict], dict]:
    name = f"{args.name}_{'colocated' if colocated else 'split'}" + (f"_{transport}" if transport else "")
    run_dir = args.workdir / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    config = rl_config(args, model_dir, colocated, name, transport)
    cmd = [sys.executable, "-m", "prime_rl.launcher.rl", "@", str(config), *args.extra]
    start = time.perf_counter()
    timeline_csv = args.workdir / f"{name}.gpu.csv"
    with open(args.workdir / f"{name}.log", "w") as log, GpuTimeline(timeline_csv) as timeline:
        # the launcher echoes orchestrator and trainer lines
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        arrivals = watch_metrics(proc, run_dir / "monitors/file/metrics.jsonl")
    total = time.perf_counter() - start
    metrics = run_dir / "monitors/file/metrics.jsonl"
    # every metric of every step (orchestrator and trainer) and the inference logs (the workers' update timings,
    # which the launcher does not echo), beside the run's log: gpu_session.sh brings them back, failed runs' too
    if metrics.is_file():
        shutil.copy(metrics, args.workdir / f"{name}.metrics.jsonl")
    for log in (run_dir / "logs/latest").glob("*.log"):
        if log.name.startswith(("inference", "trainer")):
            shutil.copy(log, args.workdir / f"{name}.{log.name}")
    if proc.returncode != 0:
        return [], dict(error=f"rl exited {proc.returncode}", run_dir=str(run_dir))
    rows: dict[int, dict] = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["step"], {}).update(row)
    loads, pushes = {}, {}
    for log in (run_dir / "logs/latest").glob("inference*.log"):
        text = log.read_text(errors="replace")
        for m in LOAD_LINE.finditer(text):
            loads[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
        pushes.update(parse_pushes(text))
    steps = []
    for step in sorted(rows):
        r = rows[step]
        # version n is loaded after trainer step n; None where no load was logged (the last step, a colocated
        # push): a 0 there pulled the medians of a 3-step run's load to half the real one
        verify, load = loads.get(step, (None, None))
        rollout = r.get("time/collect_rollouts", 0.0)
        train = r.get("time/step", 0.0)
        wall = r.get("time/wall", 0.0)
        steps.append(dict(
            step=step, rollout_s=rollout, train_s=train, wait_for_weights_s=r.get("time/wait_for_weights"),
            data_wait_s=r.get("time/data_wait"), send_batch_s=r.get("time/send_batch"),
            publish_s=r.get("time/publish_weights"),
            publish_write_s=r.get("time/publish_write"), verify_s=verify, load_s=load, wall_s=wall,
            gpu_busy=(rollout + train + (load or 0.0)) / wall if wall else None,
            beyond_rollout_train_s=wall - rollout - train if wall else None,
            rollout_tokens=r.get("batch/loss_tokens"), train_tokens_per_s=r.get("perf/throughput"),
            mfu=r.get("perf/mfu"), peak_memory_gib=r.get("perf/peak_memory"), mismatch_kl=r.get("mismatch_kl"),
            reward=r.get("reward/mean"),
        ))  # fmt: skip
        if colocated:
            steps[-1].update({field: r.get(key) for field, key in COLOCATE_KEYS.items()})
            steps[-1]["memory_gib"] = {k.removeprefix("memory/"): v for k, v in r.items() if k.startswith("memory/")}
            # the ipc push's parts (flush, gather, make_room, wake_weights, push, free): publish_s split up
            steps[-1]["publish_phases_s"] = {
                k.removeprefix("time/publish/"): v for k, v in r.items() if k.startswith("time/publish/")
            }
            # the workers' side of the same push (receive, rollback_copy, check, reload, finish; first worker), and
            # whether it loaded directly into the served parameters (worker.reload.direct_load_reason)
            workers = pushes.get(step) or [{}]
            steps[-1]["worker_phases_s"] = {
                k: v for k, v in workers[0].items() if k.endswith("_s") or k in ("seconds", "direct", "engine")
            }
    mode = "colocated" if colocated else "split"
    run = dict(
        total_s=total, run_dir=str(run_dir), mode=mode, transport=transport or ("ipc" if colocated else "filesystem"),
        gpu_memory_utilization=resolved_share(run_dir),
    )  # fmt: skip
    roles = {**timeline.roles, os.getpid(): "rl_system.py"}  # this process built the model on the GPU
    run.update(draw_timeline(args, name, timeline_csv, arrivals, roles))
    return steps, run


def resolved_share(run_dir: Path) -> float | None:
    """vLLM's `gpu_memory_utilization` as the launcher resolved it (colocated: sized beside the resting trainer),
    from the run's configs/rl.toml; None when the run wrote none."""
    import tomllib

    path = run_dir / "configs" / "rl.toml"
    if not path.is_file():
        return None
    return tomllib.loads(path.read_text()).get("inference", {}).get("vllm", {}).get("gpu_memory_utilization")


def watch_metrics(proc: subprocess.Popen, metrics: Path) -> list[tuple[float, int, str]]:
    """Waits for `proc`, noting when each metrics row appears: (time.time(), step, "train" | "rollouts")."""
    arrivals, seen = [], 0
    while True:
        done = proc.poll() is not None
        if metrics.exists():
            lines = metrics.read_text().splitlines()
            for line in lines[seen:]:
                row = json.loads(line)
                arrivals.append((time.time(), row["step"], "train" if "time/step" in row else "rollouts"))
            seen = len(lines)
        if done:
            return arrivals
        time.sleep(0.2)


def draw_timeline(args: argparse.Namespace, name: str, csv_path: Path, arrivals: list, roles: dict) -> dict:
    """{name}.svg in the workdir (GPU memory per device and process, utilization, step marks) and the GPU-busy
    share per device over the timed steps (from the warm-up's last trainer row to the last row)."""
    if not csv_path.exists():
        return {}  # no nvidia-smi here
    samples = read_samples(csv_path, roles)
    if not samples.devices:
        return {}
    marks = [(t - samples.t0, f"{kind} {step}") for t, step, kind in arrivals if kind == "train"]
    title = f"{name}: GPU memory (lines) and utilization (grey); dashed: trainer step n done"
    (args.workdir / f"{name}.svg").write_text(render_svg(samples, marks, title=title))
    warm = [t for t, step, kind in arrivals if kind == "train" and step == args.warmup]
    start = warm[0] - samples.t0 if warm else 0.0
    end = arrivals[-1][0] - samples.t0 if arrivals else float("inf")
    peaks = {role: max(m for _, m in pts) / 1024 for role, pts in samples.processes.items()}
    return dict(gpu_busy_sampled=busy_fraction(samples, start, end), process_peak_gib=peaks)


def summarize(steps: list[dict], warmup: int, baseline: dict) -> dict:
    timed = steps[warmup:] or steps
    med = lambda key: statistics.median([s[key] for s in timed if s.get(key) is not None] or [float("nan")])  # noqa: E731
    rollout_rate = statistics.median(
        [s["rollout_tokens"] / s["rollout_s"] for s in timed if s.get("rollout_tokens") and s.get("rollout_s")]
        or [float("nan")]
    )
    out = dict(
        bench="rl_system", steps_timed=len(timed), wall_s=med("wall_s"), rollout_s=med("rollout_s"),
        train_s=med("train_s"), publish_s=med("publish_s"), load_s=med("load_s"), verify_s=med("verify_s"),
        gpu_busy=med("gpu_busy"), beyond_rollout_train_s=med("beyond_rollout_train_s"), rollout_tokens_per_s=rollout_rate, train_tokens_per_s=med("train_tokens_per_s"),
        mfu=med("mfu"), peak_memory_gib=med("peak_memory_gib"), mismatch_kl=med("mismatch_kl"),
        vllm_alone_tokens_per_s=baseline.get("tokens_per_s"),
    )  # fmt: skip
    for field in COLOCATE_KEYS:
        if any(s.get(field) is not None for s in timed):
            out[field] = med(field)
    if baseline.get("tokens_per_s"):
        out["rollout_vs_vllm"] = rollout_rate / baseline["tokens_per_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-1.7b")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the medians (compile, graphs)")
    p.add_argument("--rollouts", type=int, default=256, help="samples per step (orchestrator.batch_size)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--off-policy", type=int, default=0, help="orchestrator.max_off_policy_steps")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help=f"vLLM's share (default: {SPLIT_SHARE} split, sized by the launcher colocated)",
    )
    p.add_argument(
        "--colocated",
        choices=("no", "yes", "both", "none"),
        default="no",
        help="split GPUs (no), colocated with sleep mode (yes), split then colocated (both), or no rl run (none: "
        "only the vLLM-alone baseline, for a device call of its own)",
    )
    p.add_argument(
        "--transport",
        nargs="+",
        choices=["filesystem", "ipc", "nccl"],
        help="weight transports to run each mode with, one run each (default: rl's own per mode, split filesystem, "
        "colocated ipc)",
    )
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True, help="vLLM alone first")
    p.add_argument("--baseline-timeout", type=float, default=300.0)
    p.add_argument("--name", default="rl_system")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/prime-rl-bench"))
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more rl flags (last)")
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    note(f"building the {args.shape} model")
    model_dir = build_model(args.shape, args.workdir)
    runs = []
    modes = {"no": [False], "yes": [True], "both": [False, True], "none": []}[args.colocated]
    for colocated, transport in [(c, t) for c in modes for t in args.transport or [None]]:
        mode = f"{'colocated' if colocated else 'split'}" + (f", {transport}" if transport else "")
        note(f"rl ({mode}) for {args.steps} steps (logs in {args.workdir})")
        steps, run = run_rl(args, model_dir, colocated, transport)
        for s in steps:
            print(
                json.dumps(dict(bench="rl_system_step", mode=run["mode"], transport=run["transport"], **s)), flush=True
            )
        runs.append((steps, run))
    if args.baseline and args.gpu_memory_utilization is None:
        # the first run's share as the launcher resolved it: a colocated run's vLLM holds the GPU's memory less
        # the resting trainer (0.73-0.85 of a card), and vLLM alone must get as much KV cache to be a like-for-like
        # rate (on an 80 GB card the split share, 0.35, queues 256 x 1k-token sequences: 12-05's H100 run)
        shares = [run.get("gpu_memory_utilization") for _, run in runs if run.get("gpu_memory_utilization")]
        args.gpu_memory_utilization = shares[0] if shares else SPLIT_SHARE
    note(
        f"vLLM alone, same prompts, share {args.gpu_memory_utilization}" if args.baseline else "no vLLM-alone baseline"
    )
    baseline = run_baseline(args, model_dir) if args.baseline else {}
    share = args.gpu_memory_utilization if args.baseline else None
    print(json.dumps(dict(bench="vllm_alone", gpu_memory_utilization=share, **baseline)), flush=True)
    note("done")
    for steps, run in runs:
        summary = summarize(steps, args.warmup, baseline) if steps else {}
        print(json.dumps(dict(**summary, **run, args=" ".join(sys.argv[1:]))), flush=True)


if __name__ == "__main__":
    main()
