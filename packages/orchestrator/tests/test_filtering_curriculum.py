"""Difficulty filtering and the pass-rate curriculum: pure Python, no inference."""

import numpy as np
import pytest

from prime_rl.common.config.orchestrator import CurriculumConfig, DifficultyFilterConfig
from prime_rl.orchestrator.curriculum import Curriculum, task_key
from prime_rl.orchestrator.envs.arithmetic import ArithmeticEnv
from prime_rl.orchestrator.filtering import split_by_difficulty
from prime_rl.orchestrator.rollout import Completion, Group


def group(rewards: list[float]) -> Group:
    completions = [Completion([5], [-0.1], "x") for _ in rewards]
    return Group(task={}, prompt_ids=[1], completions=completions, rewards=rewards, version=0)


def test_difficulty_band_keeps_inside_and_counts_both_sides():
    groups = [group(r) for r in ([0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1])]
    split = split_by_difficulty(groups, low=0.25, high=0.75)  # inclusive band
    assert split.kept == groups[1:4]
    assert split.too_hard == groups[:1] and split.too_easy == groups[4:]
    assert split.metrics() == {
        "filter/too_hard": 1.0,
        "filter/too_easy": 1.0,
        "filter/kept": 3.0,
        "filter/kept_fraction": 0.6,
    }
    narrow = split_by_difficulty(groups, low=0.3, high=0.7)
    assert narrow.kept == [groups[2]] and len(narrow.too_hard) == 2 and len(narrow.too_easy) == 2
    with pytest.raises(ValueError):
        DifficultyFilterConfig(low=0.8, high=0.2)


def test_curriculum_weights_peak_at_the_target():
    cur = Curriculum(CurriculumConfig(target=0.5, width=0.25, min_weight=0.05))
    assert cur.weight(None) == cur.weight(0.5) == 1.0  # unseen prompts are explored first
    assert cur.weight(0.25) == pytest.approx(np.exp(-0.5))  # one width away
    assert cur.weight(1.0) == cur.weight(0.0) == pytest.approx(np.exp(-2))  # two widths away, above the floor
    assert Curriculum(CurriculumConfig(width=0.1, min_weight=0.05)).weight(1.0) == 0.05


def test_curriculum_ema_of_pass_rates():
    cur = Curriculum(CurriculumConfig(ema=0.5))
    task = {"terms": [1, 2], "answer": 3}
    cur.update(task, [1, 1, 0, 0])
    assert cur.pass_rates[task_key(task)] == 0.5
    cur.update(task, [1, 1, 1, 1])
    assert cur.pass_rates[task_key(task)] == 0.75


def test_curriculum_prefers_prompts_near_half_and_logs_it():
    env = ArithmeticEnv(num_terms=2, max_value=4)  # 25 distinct tasks
    cur = Curriculum(CurriculumConfig(target=0.5, width=0.1, min_weight=0.01, candidates=8))
    all_tasks = [{"terms": [a, b], "answer": a + b} for a in range(5) for b in range(5)]
    # pretend history: sums to 4 are solved half the time, everything else always or never
    for task in all_tasks:
        cur.update(task, [1, 0] if task["answer"] == 4 else ([1, 1] if task["answer"] < 4 else [0, 0]))
    rng = np.random.default_rng(0)
    picks = [cur.draw(env, rng) for _ in range(400)]
    share = np.mean([t["answer"] == 4 for t in picks])
    assert share > 0.6  # 5 of 25 tasks (20% uniformly) but weight 1 vs 0.01 for the rest
    metrics = cur.pop_metrics()
    assert metrics["curriculum/prompts_tracked"] == 25.0
    assert metrics["curriculum/picked_unseen_fraction"] == 0.0
    assert 0.3 < metrics["curriculum/picked_pass_rate_mean"] < 0.6
    assert cur.pop_metrics()["curriculum/picked_weight_mean"] == 0.0  # popped: reset


def test_one_candidate_replays_plain_sampling():
    env = ArithmeticEnv(num_terms=2, max_value=99)
    one, a, b = Curriculum(CurriculumConfig(candidates=1)), np.random.default_rng(7), np.random.default_rng(7)
    assert [one.draw(env, a) for _ in range(20)] == [env.sample_tasks(1, b)[0] for _ in range(20)]
