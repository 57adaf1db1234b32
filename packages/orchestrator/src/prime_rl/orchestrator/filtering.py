"""Online difficulty filtering: train only on prompts the policy sometimes, but not always, solves.

A group's mean reward is its prompt's pass rate under the current policy (for 0/1 rewards; for dense
rewards, its mean score). Groups outside `[low, high]` are left out of the training batch and counted
(`filter/too_hard`, `filter/too_easy`); their rewards still count in reward/*, which measures the policy
on everything it sampled. Left out, not replaced: the step trains on fewer groups rather than waiting
for more rollouts (DAPO's dynamic sampling refills the batch instead; not done here, so a step never
waits on an unlucky band). Zero-advantage filtering (`advantage.filter_zero_advantage`) is the special
case low > min reward, high < max reward for binary rewards; both may be on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from prime_rl.orchestrator.rollout import Group


@dataclass
class DifficultySplit:
    kept: list[Group] = field(default_factory=list)
    too_hard: list[Group] = field(default_factory=list)
    too_easy: list[Group] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        total = max(1, len(self.kept) + len(self.too_hard) + len(self.too_easy))
        return {
            "filter/too_hard": float(len(self.too_hard)),
            "filter/too_easy": float(len(self.too_easy)),
            "filter/kept": float(len(self.kept)),
            "filter/kept_fraction": len(self.kept) / total,
        }


def split_by_difficulty(groups: list[Group], low: float, high: float) -> DifficultySplit:
    """Groups with mean reward in [low, high] are kept; the rest are too hard (< low) or too easy (> high)."""
    if low > high:
        raise ValueError(f"difficulty band low={low} > high={high}")
    split = DifficultySplit()
    for group in groups:
        pass_rate = float(np.mean(group.rewards))
        if pass_rate < low:
            split.too_hard.append(group)
        elif pass_rate > high:
            split.too_easy.append(group)
        else:
            split.kept.append(group)
    return split
