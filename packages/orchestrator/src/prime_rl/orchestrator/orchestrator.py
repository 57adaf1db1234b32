"""The orchestrator loop. Per step:

1. wait until inference serves a policy no more than `max_off_policy_steps` behind this step
   (loading newer published weights as they appear; a poller does so in the background too);
2. take finished groups from the rollout scheduler (which keeps requests in flight all along),
   dropping and counting stale ones, until the step has `batch_size // group_size` groups;
3. leave out groups whose rewards are all equal (zero advantage: no signal, but their tokens would
   count in the loss normalization and dilute the gradient), unless `advantage.filter_zero_advantage`
   is off; pack the rest into `[seq_len]` micro-batches balanced over trainer ranks and send one
   `TrainingBatch` per rank (in a thread: rollouts keep flowing while a busy trainer blocks the send).
   A step whose groups are all filtered still sends (all-padding) batches: the trainer steps in lockstep;
4. log metrics to monitors/file/metrics.jsonl and checkpoint the orchestrator state when due.

Step convention: batch `step` (0-based, as in the wire message) is logged as row `step + 1`, the number
of optimizer steps done once the trainer has trained on it, which is the row the trainer logs for the
same batch, the checkpoint directory and the policy version it publishes.

All components are injected, so tests drive the real loop with a fake control plane, a local
HTTP server for inference and a ZeroMQ receiver for the trainer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from prime_rl.common.config.orchestrator import OrchestratorConfig
from prime_rl.common.monitor import FileMonitor, Monitor
from prime_rl.common.rundir import RunDir
from prime_rl.common.wire import TrainingBatch, build_training_batch
from prime_rl.orchestrator.client import InferenceClient, SamplingArgs
from prime_rl.orchestrator.colocate import HandOver
from prime_rl.orchestrator.curriculum import Curriculum
from prime_rl.orchestrator.envs.base import Environment
from prime_rl.orchestrator.envs.handle import EnvHandle
from prime_rl.orchestrator.evaluate import run_evals
from prime_rl.orchestrator.filtering import split_by_difficulty
from prime_rl.orchestrator.heal import InferenceWatch
from prime_rl.orchestrator.off_policy import OffPolicyFilter
from prime_rl.orchestrator.packing import pack_batch
from prime_rl.orchestrator.policy import PolicyState
from prime_rl.orchestrator.rollout import Group, Sample
from prime_rl.orchestrator.scheduler import RolloutScheduler, start_envs
from prime_rl.orchestrator.state import OrchestratorState, load_state, save_state
from prime_rl.orchestrator.teacher import Distiller
from prime_rl.orchestrator.weights import InferenceControl, VersionListener, WeightUpdater

logger = logging.getLogger(__name__)

SendFn = Callable[[list[tuple[TrainingBatch, dict[str, np.ndarray]]]], None]
"""Delivers one step's per-rank batches (blocking; run in a thread)."""


@dataclass
class StepResult:
    step: int
    groups: list[Group]
    metrics: dict[str, float]


def has_signal(group: Group) -> bool:
    """False when every reward in the group is equal: all advantages are zero, there is nothing to learn
    (unless length shaping or a teacher gives the group's samples different advantages all the same)."""
    penalties = group.length_penalties
    if penalties and max(penalties) != min(penalties):
        return True
    if any(any(t) for t in group.token_advantages):
        return True
    return max(group.rewards) != min(group.rewards)


def batch_metrics(groups: list[Group]) -> dict[str, float]:
    rewards = np.asarray([r for g in groups for r in g.rewards], dtype=np.float64)
    advantages = np.asarray([a for g in groups for a in g.advantages], dtype=np.float64)
    prompt_lens = np.asarray([len(g.prompt_ids) for g in groups for _ in g.completions], dtype=np.float64)
    completion_lens = np.asarray([len(c.token_ids) for g in groups for c in g.completions], dtype=np.float64)
    # completion = everything after the first prompt; multi-turn: sampled tokens plus environment messages
    seq_lens = prompt_lens + completion_lens
    truncated = sum(c.finish_reason == "length" for g in groups for c in g.completions)
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "reward/min": float(rewards.min()),
        "reward/max": float(rewards.max()),
        "advantage/abs_mean": float(np.abs(advantages).mean()),
        "seq_len/mean": float(seq_lens.mean()),
        "seq_len/max": float(seq_lens.max()),
        "seq_len/min": float(seq_lens.min()),
        "prompt_len/mean": float(prompt_lens.mean()),
        "completion_len/mean": float(completion_lens.mean()),
        "completion_len/max": float(completion_lens.max()),
        "completion/hit_max_tokens": float(truncated / max(1, len(completion_lens))),
    }


def env_metrics(groups: list[Group], counters: dict[str, float]) -> dict[str, float]:
    """Per environment: reward, sequence length, failed rollouts, groups this step, and its fault counters
    (`env/<name>/{timeouts,crashes,failed,restarts}`, zero when none happened)."""
    metrics: dict[str, float] = {}
    for name in sorted({g.env for g in groups if g.env}):
        mine = [g for g in groups if g.env == name]
        rewards = [r for g in mine for r in g.rewards]
        lens = [len(g.prompt_ids) + len(c.token_ids) for g in mine for c in g.completions]
        metrics[f"env/{name}/reward_mean"] = float(np.mean(rewards))
        metrics[f"env/{name}/seq_len_mean"] = float(np.mean(lens))
        metrics[f"env/{name}/rollouts_failed"] = float(sum(g.num_failed for g in mine))
        metrics[f"env/{name}/groups"] = float(len(mine))
    for key, value in counters.items():
        if key.startswith("env/") and key.count("/") == 2:
            metrics[key] = float(value)
    return metrics


def log_overlong(groups: list[Group], samples: list[Sample], dropped: list[int], seq_len: int) -> None:
    """Name each sample packing dropped for being longer than seq_len (``dropped`` indexes ``samples``, the
    groups' samples in order): environment, the task's draw index, which rollout of its group, length, task."""
    starts = np.cumsum([0] + [len(g.completions) for g in groups])
    for i in dropped:
        sample, g = samples[i], int(np.searchsorted(starts, i, side="right")) - 1
        group = groups[g]
        task = json.dumps(group.task, default=str)
        logger.warning(
            "dropped an overlong sample: env %s, task #%d, rollout %d of %d: %d tokens (prompt %d + completion %d) "
            "> seq_len=%d; raise seq_len or lower sampling.max_tokens / the environment's turns. Task: %s",
            group.env or "?", group.task_index, i - starts[g], len(group.completions), sample.num_tokens,
            len(sample.prompt_ids), len(sample.completion_ids), seq_len, task[:300],
        )  # fmt: skip


class Orchestrator:
    def __init__(
        self,
        config: OrchestratorConfig,
        env: Environment | EnvHandle | list[EnvHandle],
        client: InferenceClient,
        control: InferenceControl,
        send: SendFn,
        monitor: Monitor | FileMonitor | None = None,
        teacher: Distiller | None = None,
        eval_envs: list[EnvHandle] | None = None,
    ) -> None:
        self.config = config
        self.run_dir = RunDir(config.output_dir, config.run_name)
        self.env, self.client, self.control, self.send, self.monitor = env, client, control, send, monitor
        self.seed = config.seed
        self.start_step = 0
        rng = np.random.default_rng(config.seed)
        tasks_drawn = 0
        # its own state decides: `rl` passes the step it resolved for trainer and orchestrator together
        resume = self.run_dir.resolve_resume_step(config.ckpt.resume_step, components=("orchestrator",))
        if resume is not None:
            state = load_state(self.run_dir.orchestrator_checkpoint_dir(resume))
            self.start_step, tasks_drawn, rng, self.seed = (
                state.step,
                state.tasks_drawn,
                state.restore_rng(),
                state.seed,
            )
            logger.info("resumed from step %d (%d tasks drawn so far)", self.start_step, tasks_drawn)
        self.policy = PolicyState(version=0)
        # colocated runs: inference sleeps after each step's rollouts and wakes around the next load (colocate.py)
        self.handover = (
            HandOver(control, self.policy, config.inference.sleep_level) if config.inference.sleep_level else None
        )
        self.updater = WeightUpdater(
            VersionListener(f"tcp://{config.trainer.address}:{config.trainer.weights_port}"),
            self.handover or control,
            self.policy,
            pause_mode=config.inference.pause_mode,
            poll_interval=config.weights_poll_interval,
        )
        if self.handover is not None:  # a pushed version (ipc) is in: the hand-over wakes the rest of inference
            self.updater.after_push = self.handover.after_push
        self.watch: InferenceWatch | None = None
        if config.inference.outage_timeout > 0:  # `rl` may restart inference under us (heal.py)
            self.watch = InferenceWatch(
                self.policy, self.updater, control, client.healthy, self.run_dir.broadcasts_dir,
                outage_timeout=config.inference.outage_timeout,
            )  # fmt: skip
            client.watch = self.watch
            self.updater.before_update = self.watch.wait  # a version is loaded into a server that is there
            self.updater.on_unanswered = self.watch.lost  # ... and one that died mid-update is waited out
            self.updater.server_gone = self.watch.gone  # an error reply from a dying server is its death
            self.updater.inference_down = lambda: self.watch.down
        self.off_policy = OffPolicyFilter(config.max_off_policy_steps)
        self.scheduler = RolloutScheduler(
            env,
            client,
            self.policy,
            rng,
            SamplingArgs.from_config(config.sampling, config.model.chat_template),
            group_size=config.group_size,
            groups_per_step=config.groups_per_step,
            max_off_policy_steps=config.max_off_policy_steps,
            max_concurrent=config.max_concurrent,
            start_step=self.start_step,
            tasks_drawn=tasks_drawn,
            std_normalize=config.advantage.std_normalize,
            eps=config.advantage.eps,
            advantage=config.advantage,
            curriculum=Curriculum(config.curriculum) if config.curriculum is not None else None,
            teacher=teacher,
            max_len=config.max_sample_len,
            chat_template=config.model.chat_template,
            tool_call_parser=config.model.tool_call_parser,
            follow_load=config.concurrency == "load",
            base_concurrent=config.base_concurrent,
        )
        self.step = self.start_step
        # online evals: their own environment handles ([orchestrator.eval] env), else the training ones
        self.eval_envs = eval_envs
        self._eval_tasks: list[asyncio.Task] = []

    def state(self) -> OrchestratorState:
        """The resumable state at the boundary of ``self.step``: the task stream where that step's first task
        was drawn, not the live position (tasks already drawn for later steps are drawn again after a resume)."""
        tasks_drawn, rng_state = self.scheduler.resume_point(self.step)
        return OrchestratorState(step=self.step, tasks_drawn=tasks_drawn, rng_state=rng_state, seed=self.seed)

    async def run(self) -> None:
        """Run until max_steps (forever if None); every background task stops with it."""
        # environments start (worker processes), templates and tool schemas are checked: bad input is one
        # clear error here, before any rollout
        await self.scheduler.setup()
        eval_renderers = dict(self.scheduler.renderers)
        if self.config.eval is not None and self.eval_envs is not None:
            eval_renderers = await start_envs(
                self.eval_envs, self.client, self.config.model.chat_template, self.config.model.tool_call_parser
            )
        self._eval_renderers = eval_renderers
        await self.updater.recover(self.run_dir, max_version=self.start_step)
        self.scheduler.start()
        poller = asyncio.create_task(self.updater.run(), name="weight-poller")
        try:
            if self.config.eval is not None and self.config.eval.at_start and self.step == 0:
                self._start_eval(0)
            while self.config.max_steps is None or self.step < self.config.max_steps:
                await self.run_step()
                if poller.done():  # a failed weight update stops the run
                    poller.result()
                if self.config.eval is not None and self.step % self.config.eval.interval == 0:
                    self._start_eval(self.step)
                self._check_evals()
            await asyncio.gather(*self._eval_tasks)  # the last evaluation finishes before the run ends
            self._check_evals()
        finally:
            poller.cancel()
            for task in self._eval_tasks:
                task.cancel()
            await asyncio.gather(poller, *self._eval_tasks, return_exceptions=True)
            await self.scheduler.close()
            for env in self.eval_envs or []:
                await env.close()

    def _start_eval(self, step: int) -> None:
        """Evaluate the policy inference serves now, in the background (rollouts keep flowing meanwhile)."""
        self._eval_tasks.append(asyncio.create_task(self.evaluate(step), name=f"eval-{step}"))

    def _check_evals(self) -> None:
        """Re-raise a failed evaluation (inference unreachable); forget finished ones."""
        for task in [t for t in self._eval_tasks if t.done()]:
            self._eval_tasks.remove(task)
            task.result()

    async def evaluate(self, step: int) -> dict[str, float]:
        cfg = self.config
        assert cfg.eval is not None
        version = self.policy.version
        sampling = SamplingArgs.from_config(cfg.eval.sampling or cfg.sampling, cfg.model.chat_template)
        metrics = await run_evals(
            self.client, self.eval_envs or self.scheduler.envs, self._eval_renderers, cfg.eval, sampling,
            max_len=cfg.max_sample_len, out_dir=self.run_dir.root / "evals" / f"step_{step}",
        )  # fmt: skip
        metrics["eval/policy_version"] = float(version)
        if self.monitor is not None:
            self.monitor.log(step, metrics)
        summary = " | ".join(
            f"{k.removeprefix('eval/')} {v:.3f}" for k, v in metrics.items() if "pass@1" in k or "reward_mean" in k
        )
        logger.info("eval at step %d (policy %d) | %s", step, version, summary)
        return metrics

    async def collect(self, step: int) -> list[Group]:
        groups: list[Group] = []
        while len(groups) < self.config.groups_per_step:
            group = await self.scheduler.get()
            if self.off_policy.accept(group, step):
                groups.append(group)
        # In draw order, not completion order: the same groups pack into the same rows and the trainer sums
        # in the same order, so a resumed (or repeated) run's trainer metrics match bit for bit.
        return sorted(groups, key=lambda g: g.task_index)

    async def run_step(self) -> StepResult:
        step, cfg = self.step, self.config
        start = time.perf_counter()
        await self.updater.wait_for_version(step - cfg.max_off_policy_steps, cfg.weights_timeout)
        waited = time.perf_counter() - start
        groups = await self.collect(step)
        collected = time.perf_counter() - start
        trained = [g for g in groups if has_signal(g)] if cfg.advantage.filter_zero_advantage else groups
        difficulty = None
        if cfg.difficulty_filter is not None:  # counted over all groups; trained = in the band and with signal
            difficulty = split_by_difficulty(groups, cfg.difficulty_filter.low, cfg.difficulty_filter.high)
            in_band = {id(g) for g in difficulty.kept}
            trained = [g for g in trained if id(g) in in_band]
        samples = [s for g in trained for s in g.samples()]
        per_rank, packing = pack_batch(samples, cfg.seq_len, cfg.num_train_ranks)
        log_overlong(trained, samples, packing.dropped_overlong, cfg.seq_len)

        metrics = batch_metrics(groups)  # rewards etc. over everything sampled, trained on or not
        num_zero = sum(not has_signal(g) for g in groups)
        metrics["batch/zero_advantage_groups"] = float(num_zero)
        metrics["batch/zero_advantage_fraction"] = num_zero / len(groups)
        metrics["batch/trained_groups"] = float(len(trained))
        metrics.update(self.off_policy.pop_metrics())
        metrics.update(self.scheduler.pop_metrics())  # length shaping, curriculum, distillation (when on)
        if difficulty is not None:
            metrics.update(difficulty.metrics())
        counters = self.scheduler.pop_counters()
        # env/failed counts this batch's rollouts whose scoring raised (they train with reward 0).
        metrics["env/failed"] = float(sum(g.num_failed for g in groups))
        for key in ("env/prompt_failed", "rollouts/aborted", "rollouts/prompt_too_long"):
            metrics[key] = float(counters.get(key, 0))
        if self.watch is not None:  # inference outages waited out this step, and what they cost
            heal = self.watch.pop_counters()
            for key in ("inference/outages", "inference/reloads", "inference/outage_s"):
                metrics[key] = float(heal.get(key, 0))
            metrics["rollouts/resent"] = float(counters.get("rollouts/resent", 0))
        metrics.update(env_metrics(groups, counters))
        metrics.update(packing.metrics(cfg.seq_len))
        # the trainer logs the same count as loss/tokens in this batch's row: a check that both rows match
        metrics["batch/loss_tokens"] = float(sum(mb.num_loss_tokens for mbs in per_rank for mb in mbs))
        rank_tokens = [sum(mb.num_tokens for mb in mbs) for mbs in per_rank]
        metrics["packing/rank_tokens_max_over_mean"] = max(rank_tokens) / max(1e-9, float(np.mean(rank_tokens)))
        policy_version = max(g.version for g in groups)
        metrics["policy/version"] = float(self.policy.version)
        metrics["policy/batch_version"] = float(policy_version)
        metrics["weights/updates"] = float(self.updater.num_updates)

        if self.handover is not None:  # the GPUs go to the trainer: the batch's arrival tells it they are free
            await self.handover.sleep()
            metrics.update(self.handover.pop_metrics())
        batches = [
            build_training_batch(step, policy_version, [mb.fields() for mb in mbs], cfg.sampling.temperature, metrics)
            for mbs in per_rank
        ]
        await asyncio.to_thread(self.send, batches)
        elapsed = time.perf_counter() - start
        num_tokens = sum(s.num_tokens for s in samples)
        metrics.update(
            {
                "perf/rollout_throughput": num_tokens / max(elapsed, 1e-9),
                "time/orchestrator_step": elapsed,
                "time/wait_for_weights": waited,
                "time/collect_rollouts": collected - waited,
                "time/send_batch": elapsed - collected,
            }
        )
        if self.monitor is not None:
            self.monitor.log(step + 1, metrics)  # the trainer's row for this batch (see the module docstring)
            self.monitor.log_samples(  # a sample table for [monitor.wandb]; metrics.jsonl keeps numbers only
                step + 1,
                [
                    {"task": json.dumps(g.task, default=str), "completion": c.text, "reward": r, "advantage": a}
                    for g in groups[:4]
                    for c, r, a in zip(g.completions, g.rewards, g.advantages)
                ],
            )
        logger.info(
            "step %d | reward %.3f | zero-adv groups %d | seq_len %.0f | dropped %d | failed %d | %.0f tok/s | %.2fs",
            step + 1, metrics["reward/mean"], num_zero, metrics["seq_len/mean"], metrics["off_policy/dropped"],
            metrics["env/failed"], metrics["perf/rollout_throughput"], elapsed,
        )  # fmt: skip
        self.step = step + 1
        interval = cfg.ckpt.interval
        if interval is not None and self.step % interval == 0:
            path = save_state(self.state(), self.run_dir.orchestrator_checkpoint_dir(self.step))
            logger.info("saved orchestrator state to %s", path)
        return StepResult(step, groups, metrics)
