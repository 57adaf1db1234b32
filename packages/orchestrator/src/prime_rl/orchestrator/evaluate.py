"""Evaluations: mean reward and pass@k of a served model on environments, offline (`eval`) or online.

Rollouts go through exactly the training path (`scheduler.rollout_group`: chat for single-turn
environments, token-exact multi-turn otherwise; environments in worker processes with their timeouts),
so an eval measures what training optimizes. Eval tasks come from their own seed and are the same at
every evaluation. Each evaluation writes its samples to `<run_dir>/evals/step_<step>/<env>/samples.jsonl`
and returns metrics `eval/<env>/{reward_mean,pass@<k>,completion_len_mean,failed}`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import numpy as np

from prime_rl.common.config.eval import EvalSetConfig
from prime_rl.orchestrator.client import InferenceClient, SamplingArgs
from prime_rl.orchestrator.envs.handle import Budget, EnvFailure, EnvHandle
from prime_rl.orchestrator.multiturn import ChatRenderer
from prime_rl.orchestrator.scheduler import rollout_group

logger = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task with `c` passing rollouts out of `n` (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_up_to(n: int) -> list[int]:
    ks = [1]
    while ks[-1] * 2 <= n:
        ks.append(ks[-1] * 2)
    return ks if ks[-1] == n else ks + [n]


async def evaluate_env(
    client: InferenceClient,
    env: EnvHandle,
    renderer: ChatRenderer | None,
    config: EvalSetConfig,
    sampling: SamplingArgs,
    *,
    max_len: int,
    max_concurrent: int = 32,
) -> tuple[dict[str, float], list[dict]]:
    """Evaluate one environment: (metrics, one sample record per task)."""
    n = config.rollouts_per_example
    tasks = await env.sample_tasks(config.num_examples, config.seed)
    gate = asyncio.Semaphore(max_concurrent)

    async def one(i: int, task: dict) -> dict | None:
        async with gate:
            budgets = [Budget(env.timeout) for _ in range(n)]
            try:
                messages = await env.build_prompt(task, budgets[0])
            except EnvFailure as e:
                logger.warning("eval: %s", e)
                return None
            args = sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + i * n)
            rollouts = await rollout_group(client, env, renderer, task, messages, n, args, max_len, budgets)
            if rollouts is None:
                return None
            result, scores = rollouts
            return {
                "task": task,
                "prompt": messages,
                "completions": [c.text for c in result.completions],
                "rewards": [s.reward for s in scores],
                "failed": [s.failed for s in scores],
                "completion_lens": [c.num_sampled for c in result.completions],
            }

    records = [r for r in await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))) if r is not None]
    prefix = f"eval/{env.name}"
    if not records:
        return {f"{prefix}/failed": float(len(tasks) * n)}, []
    rewards = np.asarray([r["rewards"] for r in records], dtype=np.float64)  # (tasks, n)
    passed = rewards >= config.pass_threshold
    metrics = {
        f"{prefix}/reward_mean": float(rewards.mean()),
        f"{prefix}/completion_len_mean": float(np.mean([r["completion_lens"] for r in records])),
        f"{prefix}/failed": float(sum(sum(r["failed"]) for r in records) + (len(tasks) - len(records)) * n),
        f"{prefix}/num_examples": float(len(records)),
    }
    for k in ks_up_to(n):
        metrics[f"{prefix}/pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in passed.sum(axis=1)]))
    return metrics, records


async def run_evals(
    client: InferenceClient,
    envs: list[EnvHandle],
    renderers: dict[str, ChatRenderer],
    config: EvalSetConfig,
    sampling: SamplingArgs,
    *,
    max_len: int,
    out_dir: Path,
    max_concurrent: int = 32,
) -> dict[str, float]:
    """Evaluate every environment; write `<out_dir>/<env>/samples.jsonl`; return all metrics."""
    start = time.perf_counter()
    metrics: dict[str, float] = {}
    for env in envs:
        env_metrics, records = await evaluate_env(
            client, env, renderers.get(env.name), config, sampling, max_len=max_len, max_concurrent=max_concurrent
        )
        metrics.update(env_metrics)
        path = out_dir / env.name / "samples.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for record in records:
                f.write(json.dumps(record, default=str) + "\n")
    metrics["eval/time"] = time.perf_counter() - start
    return metrics
