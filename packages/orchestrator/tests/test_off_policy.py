from prime_rl.orchestrator.off_policy import OffPolicyFilter, staleness
from prime_rl.orchestrator.rollout import Completion, Group


def group(version: int) -> Group:
    return Group(task={}, prompt_ids=[1], completions=[Completion([2], [-0.1], "x")], rewards=[1.0], version=version)


def test_stale_groups_dropped_and_counted():
    f = OffPolicyFilter(max_off_policy_steps=1)
    step = 5
    kept = [g for g in (group(5), group(4), group(3), group(1)) if f.accept(g, step)]
    assert [g.version for g in kept] == [5, 4]
    metrics = f.pop_metrics()
    assert metrics["off_policy/dropped"] == 2
    assert metrics["off_policy/staleness_max"] == 1 and metrics["off_policy/staleness_mean"] == 0.5
    assert f.pop_metrics()["off_policy/dropped"] == 0  # counters reset per step


def test_synchronous_mode_only_accepts_current_version():
    f = OffPolicyFilter(max_off_policy_steps=0)
    assert f.accept(group(2), 2) and not f.accept(group(1), 2)
    assert staleness(7, 4) == 3
