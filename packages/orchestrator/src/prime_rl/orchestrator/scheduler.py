"""Rollout scheduling: keep `max_concurrent` groups in flight against inference (with `follow_load`, a limit
between `base_concurrent` and `max_concurrent` that follows the server's load: concurrency.py); finished groups
queue up.

Each worker coroutine repeats: draw a task, build its prompt, wait until the policy gate allows
its request, sample `group_size` completions in one request (`n=group_size`, so vLLM shares the
prompt's KV cache), score them, compute group advantages, and queue the group tagged with the
version it was requested under.

Gating: groups are numbered in request order; group t is meant for step `start_step + t //
groups_per_step`, and may only be requested once inference serves a version no more than
`max_off_policy_steps` behind that step. Without the gate, synchronous runs
(`max_off_policy_steps = 0`) would burn a step's worth of rollouts on weights that are about to be
replaced. The gate is a heuristic; the orchestrator still checks every group's staleness when it
takes it (`off_policy.py`).

Not an error: an environment that raises while scoring (the rollout scores 0 and counts as failed)
and an aborted request (pause mode "abort"; the group is discarded and counted). An error: the
inference server staying unreachable (the exception ends up in the queue and stops the run).

A discarded group (no task or prompt from the environment, or an aborted request) is retried under the
same ticket with a fresh task: its step still gets `groups_per_step` groups. Dropping the ticket left a
synchronous step one group short while every later ticket waited for the next version, which needs this
step's batch first: a deadlock. An environment that never gives a prompt is retried until the run's
`stall_timeout`, when the watchdog stops the run in the orchestrator's "rollouts" phase.

A group whose request is lost to an inference outage (the client's watch, heal.py) is sent again whole
once the server is back, after the policy gate again: it is tagged with the version that samples it, never
with the one before the outage. Counted as `rollouts/resent` (rollouts, not groups).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections import Counter

import numpy as np

from prime_rl.common.config.orchestrator import AdvantageConfig
from prime_rl.common.seeding import sample_seed
from prime_rl.orchestrator.advantages import group_advantages
from prime_rl.orchestrator.client import (
    ChatResult,
    InferenceClient,
    InferenceLost,
    PromptTooLongError,
    SamplingArgs,
    resent_by_caller,
)
from prime_rl.orchestrator.concurrency import LoadLimit, follow_load
from prime_rl.orchestrator.curriculum import Curriculum
from prime_rl.orchestrator.envs.base import Environment, Score
from prime_rl.orchestrator.envs.handle import Budget, EnvFailure, EnvHandle, LocalEnv, pick_env
from prime_rl.orchestrator.multiturn import ChatRenderer, MultiTurnGroup, sample_group
from prime_rl.orchestrator.policy import PolicyState
from prime_rl.orchestrator.rollout import Group
from prime_rl.orchestrator.teacher import Distiller

logger = logging.getLogger(__name__)
MAX_TOO_LONG_STREAK = 100
"""Prompts refused in a row for not fitting max_model_len before the run stops (a dataset of such prompts)."""


class RolloutScheduler:
    def __init__(
        self,
        env: Environment | EnvHandle | list[EnvHandle],
        client: InferenceClient,
        policy: PolicyState,
        rng: np.random.Generator,
        sampling: SamplingArgs,
        *,
        group_size: int,
        groups_per_step: int,
        max_off_policy_steps: int,
        max_concurrent: int,
        start_step: int = 0,
        tasks_drawn: int = 0,
        std_normalize: bool = False,
        eps: float = 1e-6,
        advantage: AdvantageConfig | None = None,
        curriculum: Curriculum | None = None,
        teacher: Distiller | None = None,
        max_len: int | None = None,
        chat_template: str | None = None,
        tool_call_parser: str | None = None,
        follow_load: bool = False,
        base_concurrent: int | None = None,
    ) -> None:
        self.envs = as_env_handles(env)
        self.client, self.policy, self.rng, self.sampling = client, policy, rng, sampling
        self.group_size = group_size
        self.groups_per_step = groups_per_step
        self.max_off_policy_steps = max_off_policy_steps
        self.max_concurrent = max_concurrent
        # at most max_concurrent groups in flight; with follow_load a limit from base_concurrent up that follows
        # the server's load (concurrency.py)
        base = min(base_concurrent or max_concurrent, max_concurrent)
        self.limit = LoadLimit(base, max_concurrent) if follow_load else None
        self._probe: asyncio.Task | None = None
        self.start_step = start_step
        self.tasks_drawn = tasks_drawn
        self.std_normalize, self.eps = std_normalize, eps
        # baseline / length shaping; std_normalize and eps above are the fallback when no config is given
        self.advantage = advantage or AdvantageConfig(std_normalize=std_normalize, eps=eps)
        self.curriculum, self.teacher = curriculum, teacher
        # multi-turn environments: token-exact rollouts through the server's chat template (multiturn.py)
        self.max_len, self.chat_template, self.tool_call_parser = max_len, chat_template, tool_call_parser
        self.renderers: dict[str, ChatRenderer] = {}
        self._rollout_stats: Counter[str] = Counter()
        self._num_rollouts = 0
        self._length_penalties: list[float] = []
        self.queue: asyncio.Queue[Group | BaseException] = asyncio.Queue()
        self._too_long_streak = 0  # prompts refused in a row for not fitting max_model_len
        self.counters: Counter[str] = Counter()  # env/prompt_failed, rollouts/aborted, rollouts/prompt_too_long
        self._tickets = 0
        self._workers: list[asyncio.Task] = []
        self.step_marks: dict[int, tuple[int, dict]] = {}
        """target step -> (tasks_drawn, rng state) just before its first task was drawn: the task stream's
        position at that step boundary, which a checkpoint of that step saves (tasks drawn ahead for later
        steps are then drawn again, identically, after a resume)."""

    async def setup(self) -> None:
        """Start every environment and check its chat rendering: bad input fails here, before any rollout."""
        self.renderers = await start_envs(
            self.envs, self.client, self.chat_template, self.tool_call_parser, needs_max_len=self.max_len is None
        )

    async def close(self) -> None:
        await self.stop()
        for env in self.envs:
            await env.close()

    def start(self) -> None:
        self._workers = [asyncio.create_task(self._worker(), name=f"rollout-{i}") for i in range(self.max_concurrent)]
        if self.limit is not None:
            where = ", ".join(f"{root}/metrics" for root in self.client.metrics_roots)
            self._probe = asyncio.create_task(follow_load(self.limit, self.client.metrics_texts, where), name="load")

    async def stop(self) -> None:
        tasks = [*self._workers, *([self._probe] if self._probe is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._workers, self._probe = [], None

    async def get(self) -> Group:
        """Next finished group; re-raises a worker's fatal error (e.g. inference unreachable)."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def resume_point(self, step: int) -> tuple[int, dict]:
        """(tasks_drawn, rng state) at the boundary of ``step`` (live values if no task of it was drawn yet);
        forgets the marks of earlier steps."""
        for old in [s for s in self.step_marks if s < step]:
            del self.step_marks[old]
        return self.step_marks.get(step, (self.tasks_drawn, self.rng.bit_generator.state))

    def pop_metrics(self) -> dict[str, float]:
        """Metrics of the optional algorithm parts (length shaping, curriculum, distillation) since the last pop."""
        metrics: dict[str, float] = {}
        if self.advantage.overlong_window > 0:
            penalties = np.asarray(self._length_penalties or [0.0])
            metrics["advantage/length_penalty_mean"] = float(penalties.mean())
            metrics["advantage/length_penalized_fraction"] = float((penalties > 0).mean())
            self._length_penalties = []
        for part in (self.curriculum, self.teacher):
            if part is not None:
                metrics.update(part.pop_metrics())
        if self.limit is not None:
            metrics["rollouts/concurrency_limit"] = float(self.limit.limit)
        if self._num_rollouts:  # multi-turn: sums, plus the mean turns per rollout
            metrics.update({k: float(v) for k, v in self._rollout_stats.items()})
            metrics["rollout/turns"] = self._rollout_stats["rollout/turns"] / self._num_rollouts
            self._rollout_stats, self._num_rollouts = Counter(), 0
        return metrics

    def pop_counters(self) -> Counter[str]:
        """Scheduler counters plus each environment's `env/<name>/{timeouts,crashes,failed,restarts}`."""
        counters, self.counters = self.counters, Counter()
        for env in self.envs:
            for kind, count in env.pop_counters().items():
                counters[f"env/{env.name}/{kind}"] += count
        return counters

    async def _worker(self) -> None:
        try:
            with resent_by_caller():  # a request lost to an outage comes back here: the group is sent again
                await self._work()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # fatal: hand it to the orchestrator loop, which stops the run
            self.queue.put_nowait(e)

    async def _work(self) -> None:
        while True:
            if self.limit is not None:
                await self.limit.acquire()  # before the ticket: tickets keep request order
            try:
                ticket = self._tickets
                self._tickets += 1
                # a discarded group is retried under its ticket, or its step would never fill (module docstring)
                while (group := await self.generate_group(ticket)) is None:
                    pass
                self.queue.put_nowait(group)
            finally:
                if self.limit is not None:
                    await self.limit.release()

    async def generate_group(self, ticket: int | None = None) -> Group | None:
        """One task's group of rollouts for ``ticket`` (default: the next one), or None when it was discarded
        (prompt failure, abort)."""
        if ticket is None:
            ticket = self._tickets
            self._tickets += 1
        target_step = self.start_step + ticket // self.groups_per_step
        # Draw before any await so the task order depends only on the rng, not on timing. A retried first
        # ticket keeps the step's first mark: the task stream at the boundary is where that step began.
        if ticket % self.groups_per_step == 0 and target_step not in self.step_marks:
            self.step_marks[target_step] = (self.tasks_drawn, self.rng.bit_generator.state)
        task_index = self.tasks_drawn
        env = pick_env(self.envs, self.rng)
        seed = int(self.rng.integers(2**63))
        pick_rng = np.random.default_rng(int(self.rng.integers(2**63))) if self.curriculum else None
        self.tasks_drawn += 1
        budgets = [Budget(env.timeout) for _ in range(self.group_size)]
        try:
            candidates = await env.sample_tasks(self.curriculum.config.candidates if self.curriculum else 1, seed)
            task = self.curriculum.choose(candidates, pick_rng) if self.curriculum else candidates[0]
            messages = await env.build_prompt(task, budgets[0])
        except EnvFailure as e:
            logger.warning("environment %s failed to give a task and prompt: %s", env.name, e)
            self.counters["env/prompt_failed"] += 1
            return None
        sampling = self.sampling
        if sampling.seed is not None:  # vLLM seeds the group's n samples seed, seed + 1, ...
            # from (run seed, step, task index) alone: a resumed run sends the uninterrupted run's seeds
            sampling = dataclasses.replace(sampling, seed=sample_seed(sampling.seed, target_step, task_index, 0))
        renderer = self.renderers.get(env.name)
        for resend in itertools.count():
            # a group waiting for its policy version holds a slot but not the server (LoadLimit.parked_while)
            with self.limit.parked_while() if self.limit is not None else contextlib.nullcontext():
                version = await self.policy.wait_for(target_step - self.max_off_policy_steps)
            try:
                rollouts = await rollout_group(
                    self.client, env, renderer, task, messages, self.group_size, sampling, self.max_len, budgets
                )
                break
            except PromptTooLongError as e:  # counted and skipped: the ticket is retried with another task
                self.counters["rollouts/prompt_too_long"] += 1
                self._too_long_streak += 1
                if self._too_long_streak >= MAX_TOO_LONG_STREAK:  # every prompt is too long: skipping never ends
                    raise PromptTooLongError(
                        f"{self._too_long_streak} prompts in a row do not fit inference.vllm.max_model_len; the "
                        f"last: {e}. Raise seq_len / inference.vllm.max_model_len, or use shorter prompts"
                    ) from e
                logger.warning(
                    "environment %s task %d (%s) skipped: its prompt does not fit inference.vllm.max_model_len (%s)",
                    env.name, task_index, str(task)[:200], e,
                )  # fmt: skip
                return None
            except InferenceLost as e:
                if self.client.watch is None or resend >= self.client.max_retries:
                    raise
                self.counters["rollouts/resent"] += self.group_size
                logger.warning("%s: group of task %d is sent again once inference is back", e, task_index)
                await self.client.watch.wait()  # raises when inference never came back
        self._too_long_streak = 0
        if rollouts is None:
            self.counters["rollouts/aborted"] += 1
            return None
        result, scores = rollouts
        for c in result.completions:
            self._rollout_stats.update(c.stats)
            self._num_rollouts += bool(c.stats)
        rewards = [s.reward for s in scores]
        num_failed = sum(s.failed for s in scores)
        adv = self.advantage
        advantages, penalties = group_advantages(
            rewards, [c.num_sampled for c in result.completions], max_tokens=self.sampling.max_tokens,
            baseline=adv.baseline, std_normalize=adv.std_normalize, eps=adv.eps,
            overlong_window=adv.overlong_window, overlong_penalty=adv.overlong_penalty,
        )  # fmt: skip
        if self.curriculum is not None:
            self.curriculum.update(task, rewards)
        token_advantages: list[list[float]] = []
        if self.teacher is not None:
            advantages = advantages * np.float32(self.teacher.reward_weight)
            token_advantages = await self.teacher.token_advantages(result.prompt_ids, result.completions)
        length_penalties = [float(p) for p in penalties] if adv.overlong_window > 0 else []
        self._length_penalties.extend(length_penalties)
        return Group(
            env=env.name,
            task=task,
            prompt_ids=result.prompt_ids,
            completions=result.completions,
            rewards=rewards,
            version=version,
            num_failed=num_failed,
            advantages=[float(a) for a in advantages],
            token_advantages=token_advantages,
            length_penalties=length_penalties,
            task_index=task_index,
        )


def as_env_handles(env: Environment | EnvHandle | list[EnvHandle]) -> list[EnvHandle]:
    if isinstance(env, Environment):
        return [LocalEnv(env)]
    return [env] if isinstance(env, EnvHandle) else list(env)


async def score_rollout(env: EnvHandle, task, text: str, messages, error: str | None, budget: Budget) -> Score:
    """The rollout's score; a rollout whose environment failed earlier, or fails now, scores 0 and counts as failed."""
    if error is not None:
        return Score(0.0, True, error)
    try:
        return await env.score(task, text, messages, budget)
    except EnvFailure as e:
        logger.warning("%s", e)
        return Score(0.0, True, str(e))


async def rollout_group(
    client: InferenceClient,
    env: EnvHandle,
    renderer: ChatRenderer | None,
    task,
    messages,
    n: int,
    sampling: SamplingArgs,
    max_len: int | None,
    budgets: list[Budget],
) -> tuple[ChatResult | MultiTurnGroup, list[Score]] | None:
    """Sample `n` rollouts of one task (one chat request, or token-exact multi-turn rollouts) and score them;
    None when inference aborted a request (a weight update in pause mode "abort")."""
    if env.info.multi_turn:
        result = await sample_group(
            client, renderer, env, task, messages, n, sampling, max_len=max_len, budgets=budgets
        )
        conversations = [t.messages for t in result.trajectories]
        errors = [t.error for t in result.trajectories]
    else:
        result = await client.sample(messages, n, sampling)
        conversations, errors = [None] * n, [None] * n
    if any(c.finish_reason == "abort" for c in result.completions):
        return None
    scores = await asyncio.gather(
        *(
            score_rollout(env, task, c.text, m, e, b)
            for c, m, e, b in zip(result.completions, conversations, errors, budgets)
        )
    )
    return result, list(scores)


async def start_envs(
    envs: list[EnvHandle],
    client: InferenceClient,
    chat_template: str | None,
    tool_call_parser: str | None,
    *,
    needs_max_len: bool = False,
) -> dict[str, ChatRenderer]:
    """Start environments (worker processes) and set up a checked chat renderer per multi-turn one.
    Raises one clear error (unknown env, missing package, template without tools, refused schema)."""
    renderers: dict[str, ChatRenderer] = {}
    for env in envs:
        await env.start()
        if tool_call_parser is not None:  # orchestrator.model.tool_call_parser: how this model writes calls
            env.info = dataclasses.replace(env.info, tool_call_parser=tool_call_parser)
        if not env.info.multi_turn:
            continue
        if needs_max_len:
            raise ValueError(f"environment {env.name} is multi-turn: the scheduler needs max_len")
        renderer = ChatRenderer(client, tools=env.info.tools, chat_template=chat_template)
        try:
            await renderer.setup()
        except ValueError as e:
            raise ValueError(f"environment {env.name}: {e}") from None
        renderers[env.name] = renderer
    return renderers
