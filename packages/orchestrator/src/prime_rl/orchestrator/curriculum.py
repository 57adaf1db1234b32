"""A pass-rate curriculum: sample prompts the policy solves about half the time more often.

Each pick draws `candidates` tasks from the environment (all randomness from the scheduler's rng, so a
run replays) and chooses one with weight

    w(p) = max(min_weight, exp(-(p - target)^2 / (2 width^2)))

where p is the prompt's pass rate so far (an exponential moving average of its groups' mean reward,
`ema` the newest group's share). A prompt never seen has p = target: new prompts are explored first.
Prompts are identified by their task dict (JSON), so this pays off in environments whose tasks repeat
(a dataset, or a small procedural space such as the arithmetic example's 25 sums); with a huge task
space almost every candidate is new and picks are close to uniform.

Left out: the pass-rate table is not checkpointed (a resumed run starts it empty), and no prompt is
retired for good (min_weight keeps every one reachable, so a forgotten skill is seen again).
"""

from __future__ import annotations

import json
import math

import numpy as np

from prime_rl.common.config.orchestrator import CurriculumConfig
from prime_rl.orchestrator.envs.base import Environment, Task


def task_key(task: Task) -> str:
    return json.dumps(task, sort_keys=True, default=str)


class Curriculum:
    def __init__(self, config: CurriculumConfig) -> None:
        self.config = config
        self.pass_rates: dict[str, float] = {}
        self._picked_rates: list[float] = []  # estimate at pick time, seen prompts only
        self._picked_unseen = 0
        self._picked_weights: list[float] = []

    def weight(self, pass_rate: float | None) -> float:
        c = self.config
        p = c.target if pass_rate is None else pass_rate
        return max(c.min_weight, math.exp(-((p - c.target) ** 2) / (2 * c.width**2)))

    def draw(self, env: Environment, rng: np.random.Generator) -> Task:
        """One task: `candidates` drawn from env, one of them chosen by weight."""
        return self.choose(env.sample_tasks(self.config.candidates, rng), rng)

    def choose(self, candidates: list[Task], rng: np.random.Generator) -> Task:
        """One of `candidates` (drawn from an environment), chosen by weight."""
        rates = [self.pass_rates.get(task_key(t)) for t in candidates]
        weights = np.asarray([self.weight(p) for p in rates])
        i = int(rng.choice(len(candidates), p=weights / weights.sum())) if len(candidates) > 1 else 0
        if rates[i] is None:
            self._picked_unseen += 1
        else:
            self._picked_rates.append(rates[i])
        self._picked_weights.append(float(weights[i]))
        return candidates[i]

    def update(self, task: Task, rewards: list[float]) -> None:
        """Fold one scored group of `task` into its pass-rate estimate."""
        key, rate = task_key(task), float(np.mean(rewards))
        old = self.pass_rates.get(key)
        self.pass_rates[key] = rate if old is None else (1 - self.config.ema) * old + self.config.ema * rate

    def pop_metrics(self) -> dict[str, float]:
        num_picked = len(self._picked_rates) + self._picked_unseen
        metrics = {
            "curriculum/prompts_tracked": float(len(self.pass_rates)),
            "curriculum/picked_unseen_fraction": self._picked_unseen / max(1, num_picked),
            "curriculum/picked_weight_mean": float(np.mean(self._picked_weights)) if self._picked_weights else 0.0,
        }
        if self._picked_rates:
            metrics["curriculum/picked_pass_rate_mean"] = float(np.mean(self._picked_rates))
        self._picked_rates, self._picked_unseen, self._picked_weights = [], 0, []
        return metrics
