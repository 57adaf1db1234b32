"""What the rollout's response shape costs the inference server: the orchestrator's exact chat request (per-token
logprobs and token ids) against the same generation without them, on a real vLLM server.

    python benchmarks/response_cost.py                                # a tiny model, vLLM on this machine (CPU)
    python benchmarks/response_cost.py --shape qwen3-1.7b --concurrent 32 --gpu-memory-utilization 0.35

Why: on one H200 the `rl` rollouts ran 1.21-1.36x slower than vLLM's offline `LLM.generate` on the same prompts
with `logprobs = 0` (benchmarks/results/rl_system.md), and the orchestrator's own ceiling is 216k tok/s
(benchmarks/results/rollout_path.md). What is left is the server: every sampled token becomes a logprob object
and JSON in vLLM's API-server process, and in a synchronous step every request ends at the same decode step,
so that work queues up after the last token.

How: one `vllm serve` (vLLM's OpenAI server, the handlers `prime_rl.inference.server` mounts), seeded sampling
with `ignore_eos` so every variant generates the same `n x max_tokens` tokens; `--concurrent` requests at once,
variants alternating over `--reps` rounds after one warm-up round. Variants:
- `ours`: the body `InferenceClient.build_request` sends (logprobs, top_logprobs 0, token ids, tokens as ids);
- `plain`: the same without logprobs and token ids (what the response costs beyond generation);
- `samples`: what `api = "samples"` sends, prime-rl's samples route (`prime_rl.inference.samples`, mounted with
  vLLM's `--middleware`): the same ids and logprobs, as arrays.
Per variant: the median wall of a round, the median gap from its first to its last response (the tail), bytes.
Prints one JSON line per round and a summary line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prime_rl.common.net import free_port
from prime_rl.common.vllm_compat import engine_env_defaults
from prime_rl.common.wire import SAMPLES_PATH
from prime_rl.inference.samples import MIDDLEWARE as SAMPLES_MIDDLEWARE
from prime_rl.orchestrator.client import InferenceClient, SamplingArgs

MESSAGES = [{"role": "user", "content": "What is 3 + 4?"}]


def bodies(root: str, n: int, max_tokens: int) -> dict[str, tuple[str, dict]]:
    """Each variant's (url, body); `root` is the server's http://host:port."""
    client = InferenceClient("http://unused", "m")
    sampling = SamplingArgs(max_tokens=max_tokens, temperature=1.0, seed=1)
    ours = client.build_request(MESSAGES, n, sampling)
    ours["ignore_eos"] = True  # every variant generates the same tokens
    plain = {k: v for k, v in ours.items() if k not in ("logprobs", "top_logprobs", "return_token_ids")}
    plain.pop("return_tokens_as_token_ids")
    tokenize = {"model": "m", "messages": MESSAGES, "add_generation_prompt": True, "add_special_tokens": False}
    prompt_ids = json.loads(post_body(f"{root}/tokenize", tokenize))["tokens"]  # what api = "samples" sends first
    samples = {**client.build_samples_request(prompt_ids, n, sampling), "ignore_eos": True}
    chat = f"{root}/v1/chat/completions"
    return {"ours": (chat, ours), "plain": (chat, plain), "samples": (f"{root}{SAMPLES_PATH}", samples)}


def post_body(url: str, body: dict) -> bytes:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=1800).read()


def post(url: str, body: dict) -> tuple[float, int]:
    data = post_body(url, body)
    return time.perf_counter(), len(data)


def round_of(url: str, body: dict, concurrent: int) -> dict:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrent) as pool:
        done = list(pool.map(lambda _: post(url, body), range(concurrent)))
    ends = sorted(t for t, _ in done)
    return dict(wall_s=ends[-1] - start, tail_s=ends[-1] - ends[0], bytes=sum(b for _, b in done))


def start_server(model: Path, port: int, args: argparse.Namespace, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(args.max_tokens + 512), "--dtype", "bfloat16",
           "--middleware", SAMPLES_MIDDLEWARE]  # fmt: skip
    if args.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    # the engine settings `inference` applies (without flashinfer vLLM 0.26's sampler import fails at start-up)
    defaults = engine_env_defaults(importlib.util.find_spec("flashinfer") is not None)
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", **defaults, **os.environ}
    server = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"vLLM exited {server.returncode} while starting; see {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            time.sleep(2)
    server.kill()
    raise SystemExit(f"vLLM not ready after {args.start_timeout:.0f} s; see {log}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=None, help="a benchmarks/trainer.py shape (random weights); default: tiny")
    p.add_argument("--n", type=int, default=8, help="samples per request (group_size)")
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--concurrent", type=int, default=4, help="requests at once (rl: batch_size / group_size)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/prime-rl-bench"))
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.shape is None:
        from prime_rl.common.testing import make_tiny_model

        model = make_tiny_model(args.workdir / "response-cost-tiny", kind="qwen3")
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        from rl_system import build_model  # random weights of the shape, the tiny tokenizer

        model = build_model(args.shape, args.workdir)
    port = free_port()
    server = start_server(model, port, args, args.workdir / "response_cost.log")
    try:
        variants = bodies(f"http://127.0.0.1:{port}", args.n, args.max_tokens)
        for url, body in variants.values():  # warm-up: compile, CUDA graphs, caches
            round_of(url, body, args.concurrent)
        rounds: dict[str, list[dict]] = {name: [] for name in variants}
        for rep in range(args.reps):
            for name, (url, body) in variants.items():
                r = round_of(url, body, args.concurrent)
                rounds[name].append(r)
                print(json.dumps(dict(bench="response_cost_round", rep=rep, variant=name, **r)), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    tokens = args.concurrent * args.n * args.max_tokens
    summary = {
        name: dict(
            wall_s=statistics.median(r["wall_s"] for r in rs),
            tail_s=statistics.median(r["tail_s"] for r in rs),
            bytes=rs[0]["bytes"],
        )
        for name, rs in rounds.items()
    }
    extra = summary["ours"]["wall_s"] - summary["plain"]["wall_s"]
    samples_extra = summary["samples"]["wall_s"] - summary["plain"]["wall_s"]
    print(json.dumps(dict(bench="response_cost", shape=args.shape or "tiny", tokens_per_round=tokens,
                          concurrent=args.concurrent, n=args.n, max_tokens=args.max_tokens, **summary,
                          extra_s=extra, extra_us_per_token=extra / tokens * 1e6,
                          samples_extra_us_per_token=samples_extra / tokens * 1e6)), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
