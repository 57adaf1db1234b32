"""Off-policy accounting: a group sampled with policy version v is `step - v` steps stale in batch `step`.

Groups staler than `max_off_policy_steps` are dropped (and counted as `off_policy/dropped`), so the
importance ratio the trainer applies never has to bridge more than that many updates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prime_rl.orchestrator.rollout import Group


def staleness(step: int, version: int) -> int:
    """How many policy updates lie between the sampling policy and the one trained at `step`."""
    return step - version


@dataclass
class OffPolicyFilter:
    max_off_policy_steps: int
    num_dropped: int = 0
    staleness_seen: list[int] = field(default_factory=list)

    def accept(self, group: Group, step: int) -> bool:
        """True if `group` may train at `step`; otherwise it is counted as dropped."""
        lag = staleness(step, group.version)
        if lag > self.max_off_policy_steps:
            self.num_dropped += 1
            return False
        self.staleness_seen.append(lag)
        return True

    def pop_metrics(self) -> dict[str, float]:
        seen = self.staleness_seen or [0]
        metrics = {
            "off_policy/dropped": float(self.num_dropped),
            "off_policy/staleness_mean": sum(seen) / len(seen),
            "off_policy/staleness_max": float(max(seen)),
        }
        self.num_dropped, self.staleness_seen = 0, []
        return metrics
