"""What one rollout and one group of rollouts are, once sampled and scored (no I/O here)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from prime_rl.orchestrator.envs.base import Task


@dataclass
class Completion:
    """One sampled completion as the inference API returned it."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None = None
    mask: list[bool] | None = None
    """Multi-turn: True on sampled tokens, False on tokens the environment / chat template added; None = all sampled."""
    stats: dict[str, float] = field(default_factory=dict)
    """Per-rollout counters summed into the step's metrics (turns, tool calls, token mismatches)."""
    routed_experts: np.ndarray | None = None
    """(prompt + completion tokens - 1, layers, top_k): the experts inference routed each token to (vLLM's routed
    experts, `orchestrator.routed_experts`); the last sampled token was never forwarded. None: not asked for, or
    a multi-turn rollout (its turns' routings are not stitched together)."""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"completion has {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs; "
                "the inference server must return one logprob per sampled token (request logprobs)"
            )
        if self.mask is not None and len(self.mask) != len(self.token_ids):
            raise ValueError(f"completion has {len(self.token_ids)} token ids but a mask of {len(self.mask)}")

    @property
    def num_sampled(self) -> int:
        return len(self.token_ids) if self.mask is None else sum(self.mask)


@dataclass
class Sample:
    """One training sample: a prompt and a completion, with its advantage. Arrays are per token."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    advantage: float
    reward: float = 0.0
    token_advantages: list[float] | None = None
    """Per-token terms added to `advantage` on each completion token (on-policy distillation); None = none."""
    completion_mask: list[bool] | None = None
    """Which completion tokens are trained on (multi-turn: the sampled ones); None = all."""
    routed_experts: np.ndarray | None = None
    """(tokens - 1, layers, top_k): inference's experts for the prompt then the completion; None = not reported."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class Group:
    """`group_size` completions of one task, scored, tagged with the policy version that sampled them."""

    task: Task
    prompt_ids: list[int]
    completions: list[Completion]
    rewards: list[float]
    version: int
    num_failed: int = 0
    env: str = ""
    """Name of the environment the task came from (per-environment metrics)."""
    advantages: list[float] = field(default_factory=list)
    token_advantages: list[list[float]] = field(default_factory=list)
    """Per completion, per token: added to its advantage (distillation); empty = none."""
    length_penalties: list[float] = field(default_factory=list)
    """Per completion: the overlong penalty subtracted from its reward before the baseline; empty = off."""
    task_index: int = -1
    """The scheduler's draw order (tasks drawn before this one): a step's batch is ordered by it, not by
    completion, so packing and the trainer's float sums do not depend on timing."""

    def samples(self) -> list[Sample]:
        if len(self.advantages) != len(self.completions):
            raise ValueError("advantages are not computed for this group yet")
        token_advantages = self.token_advantages or [None] * len(self.completions)
        return [
            Sample(self.prompt_ids, c.token_ids, c.logprobs, float(a), float(r), t, c.mask, c.routed_experts)
            for c, a, r, t in zip(self.completions, self.advantages, self.rewards, token_advantages)
        ]

    def reward_array(self) -> np.ndarray:
        return np.asarray(self.rewards, dtype=np.float32)
