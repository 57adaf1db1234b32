"""The orchestrator's side of the rollout path on CPU: the real `RolloutScheduler` + `InferenceClient` against a
fake vLLM server in a subprocess, with no GPU (issue #29 item 5: `rl` collected rollouts at 8.7k tok/s where
vLLM's offline `LLM.generate` ran at 17.7k on the same GPU share).

    python benchmarks/rollout_path.py                      # both modes, 256 rollouts x 1,024 tokens
    python benchmarks/rollout_path.py --mode instant --profile

The fake server (this file, `--serve`, a subprocess so that its CPU is not the orchestrator's) answers
`/v1/chat/completions` as vLLM 0.26-0.32 formats a chat completion with `logprobs`, `return_token_ids` and
`return_tokens_as_token_ids` (what `InferenceClient.build_request` asks for): every choice has `max_tokens`
token ids, and one `logprobs.content` entry per token (`"token_id:<id>"`, a float32 logprob, its bytes, no top
logprobs), so the bodies are as large as vLLM's (about 0.1 kB a token).

- ``instant``: the server answers at once: the orchestrator's own ceiling (tokens/s it can take in), with a
  cProfile top list of the orchestrator's process over the steps (``--profile``; by own time).
- ``paced``: the server is one vLLM engine with a fixed decode step (`--max-num-seqs` / `--engine-rate`
  seconds, 14.5 ms for 256 / 17.7k): every running sequence gets one token a step, at most `--max-num-seqs`
  run (the rest wait), so tokens/s grow with the sequences in flight up to the offline rate, as a memory-bound
  engine's do. It reports whether the orchestrator keeps every sequence in flight.

The environment is `rl_system.py`'s (arithmetic, in its default worker process). The loop is the synchronous `rl`
one (`max_off_policy_steps = 0`, concurrency as the config resolves it): a step
collects `rollouts / group_size` groups, then the policy gate opens the next version (no trainer, no weight load:
`--gap-s` stands in for them). In-flight counts come from the server's arrival and reply times (one clock:
CLOCK_MONOTONIC is system-wide). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

VOCAB = 151_936


# ---- the fake server (runs in its own process) ----------------------------------------------------------------


def choice_body(index: int, max_tokens: int, rng: np.random.Generator) -> dict:
    """One choice as vLLM writes it: token ids, one logprob entry per token, the decoded text."""
    ids = rng.integers(3, VOCAB, size=max_tokens)
    logprobs = rng.normal(-12.0, 1.0, size=max_tokens).astype(np.float32)
    pieces = ["".join(chr(97 + int(x) % 26) for x in rng.integers(0, 26, size=4)) for _ in range(max_tokens)]
    content = [
        {"token": f"token_id:{int(t)}", "logprob": float(lp), "bytes": list(p.encode()), "top_logprobs": []}
        for t, lp, p in zip(ids, logprobs, pieces)
    ]
    return {
        "index": index,
        "message": {"role": "assistant", "content": "".join(pieces), "refusal": None, "annotations": None,
                    "audio": None, "function_call": None, "tool_calls": [], "reasoning_content": None},
        "logprobs": {"content": content},
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": [int(t) for t in ids],
    }  # fmt: skip


class FakeEngine:
    """Answers chat completions; ``step_s`` > 0: one decode step per ``step_s`` for at most ``max_num_seqs``."""

    def __init__(self, step_s: float, max_num_seqs: int) -> None:
        self.step_s, self.max_num_seqs = step_s, max_num_seqs
        self.bodies: dict[tuple[int, int], bytes] = {}
        self.log: list[tuple[float, float, int]] = []  # (arrived, replied, n) per request
        self.queue: list[list] = []  # [tokens left, n, future] in arrival order
        self.generated = 0

    def body(self, n: int, max_tokens: int) -> bytes:
        if (n, max_tokens) not in self.bodies:
            rng = np.random.default_rng(n * 100_003 + max_tokens)
            self.bodies[n, max_tokens] = json.dumps({
                "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
                "choices": [choice_body(i, max_tokens, rng) for i in range(n)],
                "service_tier": None, "system_fingerprint": None,
                "usage": {"prompt_tokens": 30, "completion_tokens": n * max_tokens, "total_tokens": 30 + n * max_tokens},
                "prompt_logprobs": None, "prompt_token_ids": list(range(100, 130)), "kv_transfer_params": None,
            }).encode()  # fmt: skip
        return self.bodies[n, max_tokens]

    async def complete(self, request: dict) -> bytes:
        arrived, n, max_tokens = time.monotonic(), int(request.get("n", 1)), int(request["max_tokens"])
        body = self.body(n, max_tokens)
        if self.step_s > 0:
            done = asyncio.get_running_loop().create_future()
            self.queue.append([max_tokens, n, done])
            await done
        self.log.append((arrived, time.monotonic(), n))
        return body

    async def run(self) -> None:
        """The decode loop: the first ``max_num_seqs`` sequences in arrival order get a token each step."""
        while True:
            await asyncio.sleep(self.step_s)
            budget = self.max_num_seqs
            for entry in self.queue:
                if budget < entry[1]:
                    break
                budget -= entry[1]
                entry[0] -= 1
                self.generated += entry[1]
            for entry in [e for e in self.queue if e[0] <= 0]:
                self.queue.remove(entry)
                entry[2].set_result(None)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Minimal HTTP/1.1 with keep-alive: enough for httpx."""
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
                raw = await reader.readexactly(int(headers.get("content-length", 0)))
                status, body = 404, b"{}"
                if method == "POST" and path == "/v1/chat/completions":
                    status, body = 200, await self.complete(json.loads(raw))
                elif path == "/stats":
                    status, body = 200, json.dumps({"log": self.log}).encode()
                    self.log = []
                writer.write(b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                             % (status, len(body)) + body)  # fmt: skip
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


async def serve(port_file: Path, step_s: float, max_num_seqs: int) -> None:
    engine = FakeEngine(step_s, max_num_seqs)
    server = await asyncio.start_server(engine.handle, "127.0.0.1", 0, backlog=1024)
    port_file.write_text(str(server.sockets[0].getsockname()[1]))
    async with server:
        await asyncio.gather(server.serve_forever(), *([engine.run()] if step_s > 0 else []))


# ---- the orchestrator side ------------------------------------------------------------------------------------


def start_server(args: argparse.Namespace, step_s: float) -> tuple[subprocess.Popen, str]:
    port_file = Path(f"/tmp/rollout_path_port_{os.getpid()}")
    port_file.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--serve", str(port_file), "--step-s", str(step_s),
           "--max-num-seqs", str(args.max_num_seqs)]  # fmt: skip
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 30
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"fake server did not start (exit {proc.poll()})")
        time.sleep(0.05)
    port = port_file.read_text()
    port_file.unlink()
    return proc, f"http://127.0.0.1:{port}/v1"


def in_flight(log: list[tuple[float, float, int]], start: float, end: float) -> dict:
    """Sequences in flight at the server over [start, end]: time-weighted mean, max, share of time at the max
    the step can have, and the time until every one of them was in."""
    events = sorted([(a, n) for a, _, n in log] + [(r, -n) for _, r, n in log])
    total, level, last, weighted, peak, full_s = sum(n for *_, n in log), 0, start, 0.0, 0, 0.0
    all_in_at = None
    for t, dn in events:
        if level == total:
            full_s += t - last
        weighted += level * (t - last)
        level, last = level + dn, t
        peak = max(peak, level)
        if level == total and all_in_at is None:
            all_in_at = t - start
    span = max(end - start, 1e-9)
    return dict(mean=weighted / span, max=peak, all_in_after_s=all_in_at, all_in_share=full_s / span)


async def run_steps(args: argparse.Namespace, base_url: str, profiler: cProfile.Profile | None) -> list[dict]:
    from prime_rl.common.config.orchestrator import OrchestratorConfig
    from prime_rl.orchestrator.client import InferenceClient, SamplingArgs
    from prime_rl.orchestrator.entrypoint import build_env_handles
    from prime_rl.orchestrator.policy import PolicyState
    from prime_rl.orchestrator.scheduler import RolloutScheduler

    config = OrchestratorConfig(
        batch_size=args.rollouts, group_size=args.group_size, max_off_policy_steps=0, env={"type": "arithmetic"}
    )
    client = InferenceClient(base_url, "bench")
    policy = PolicyState(version=0)
    scheduler = RolloutScheduler(
        build_env_handles(config.env), client, policy, np.random.default_rng(0),
        SamplingArgs(max_tokens=args.max_tokens, temperature=1.0), group_size=args.group_size,
        groups_per_step=config.groups_per_step, max_off_policy_steps=0, max_concurrent=config.max_concurrent,
        follow_load=config.concurrency == "load", base_concurrent=config.base_concurrent,
    )  # fmt: skip
    await scheduler.setup()
    if profiler is not None:  # the steps only: not imports and the environment worker's start
        profiler.enable()
    scheduler.start()
    steps = []
    try:
        for step in range(args.steps):
            start = time.monotonic()
            groups = [await scheduler.get() for _ in range(config.groups_per_step)]
            end = time.monotonic()
            tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
            log = (await client._http.get(base_url.removesuffix("/v1") + "/stats")).json()["log"]
            mine = [e for e in log if e[0] < end]  # requests of the next step (already sent) are not this step's
            first, replied = min(a for a, _, _ in mine), max(r for _, r, _ in mine)
            steps.append(dict(step=step, seconds=end - start, tokens=tokens, tokens_per_s=tokens / (end - start),
                              in_flight_sequences=in_flight(mine, start, end),
                              # the orchestrator's own time: before the first request reached the server, and
                              # after the server's last reply (reading, parsing, scoring the last groups)
                              before_first_request_s=first - start, after_last_reply_s=end - replied,
                              server_s=replied - first))  # fmt: skip
            await policy.close()  # the weight update: the next step's groups wait for version step + 1
            await asyncio.sleep(args.gap_s)
            await policy.open(version=step + 1)
    finally:
        if profiler is not None:
            profiler.disable()
        await scheduler.close()
        await client.aclose()
    return steps


def run_mode(args: argparse.Namespace, mode: str) -> dict:
    step_s = args.max_num_seqs / args.engine_rate if mode == "paced" else 0.0
    proc, base_url = start_server(args, step_s)
    profiler = cProfile.Profile() if args.profile and mode == "instant" else None
    try:
        steps = asyncio.run(run_steps(args, base_url, profiler))
    finally:
        proc.terminate()
        proc.wait()
    timed = steps[args.warmup :] or steps
    out = dict(mode=mode, steps=steps, tokens_per_s=float(np.median([s["tokens_per_s"] for s in timed])))
    if mode == "paced":
        out["engine_tokens_per_s"] = args.engine_rate
        out["vs_engine"] = out["tokens_per_s"] / args.engine_rate
    if profiler is not None:
        stats = pstats.Stats(profiler).sort_stats("tottime")
        top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[: args.top]  # (file, line, fn) -> cc, nc, tt, ct
        out["profile_tottime_top"] = [
            dict(fn=f"{Path(f).name}:{line}:{fn}", calls=nc, tottime_s=round(tt, 3), cumtime_s=round(ct, 3))
            for (f, line, fn), (_, nc, tt, ct, _) in top
        ]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["instant", "paced", "both"], default="both")
    p.add_argument("--rollouts", type=int, default=256, help="samples per step (orchestrator.batch_size)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="steps left out of the medians")
    p.add_argument("--gap-s", type=float, default=0.0, help="seconds between steps (the trainer and weight load)")
    p.add_argument("--engine-rate", type=float, default=17_700.0, help="paced: tokens/s with max-num-seqs running")
    p.add_argument("--max-num-seqs", type=int, default=256, help="paced: sequences the engine runs at once")
    p.add_argument("--profile", action="store_true", help="instant: cProfile the orchestrator's process")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--step-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve is not None:
        asyncio.run(serve(args.serve, args.step_s, args.max_num_seqs))
        return
    modes = ["instant", "paced"] if args.mode == "both" else [args.mode]
    results = [run_mode(args, mode) for mode in modes]
    print(json.dumps(dict(bench="rollout_path", args=" ".join(sys.argv[1:]), results=results)))


if __name__ == "__main__":
    main()
