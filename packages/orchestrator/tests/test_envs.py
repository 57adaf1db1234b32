import importlib.util

import numpy as np
import pytest

from prime_rl.common.config.orchestrator import ArithmeticEnvConfig, ReasoningGymEnvConfig, ReverseTextEnvConfig
from prime_rl.orchestrator.envs import Environment, build_environment, score_safely
from prime_rl.orchestrator.envs.arithmetic import parse_answer
from prime_rl.orchestrator.envs.reverse_text import edit_distance, similarity


def test_edit_distance_and_similarity():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == 3
    assert similarity("abc", "abc") == 1.0
    assert similarity("", "") == 1.0
    assert similarity("xyz", "abc") == 0.0
    assert 0 < similarity("abd", "abc") < 1


@pytest.mark.parametrize("unit", ["chars", "words"])
def test_reverse_text_is_dense_and_deterministic(unit):
    env = build_environment(ReverseTextEnvConfig(unit=unit, min_len=3, max_len=5))
    tasks = env.sample_tasks(8, np.random.default_rng(0))
    assert tasks == env.sample_tasks(8, np.random.default_rng(0))
    for task in tasks:
        prompt = env.build_prompt(task)
        assert prompt[-1]["role"] == "user" and task["text"] in prompt[-1]["content"]
        assert env.score(task, f"  {task['answer']}\n") == 1.0
        assert 0.0 < env.score(task, task["answer"][:-1]) < 1.0  # partial credit


def test_arithmetic_exact_match():
    env = build_environment(ArithmeticEnvConfig(num_terms=3, max_value=9))
    (task,) = env.sample_tasks(1, np.random.default_rng(3))
    assert task["answer"] == sum(task["terms"])
    answer = task["answer"]
    assert env.score(task, f"{answer}") == 1.0 and env.score(task, f" {answer}\n") == 1.0
    assert env.score(task, f"{answer + 1}") == 0.0
    # the answer only: no junk before or after it, no second number, no other spelling
    for loose in (f"The answer is {answer}", f"xx{answer}", f"3 {answer}", f"{answer} {answer}", f"{answer}.",
                  f"0{answer}", f"+{answer}", "no idea", ""):  # fmt: skip
        assert env.score(task, loose) == 0.0, loose
    assert parse_answer("-5") == -5 and parse_answer("0") == 0 and parse_answer("1,234") is None


class Exploding(Environment):
    name = "exploding"

    def sample_tasks(self, n, rng):
        return [{}] * n

    def build_prompt(self, task):
        return [{"role": "user", "content": "x"}]

    def score(self, task, completion_text):
        if completion_text == "nan":
            return float("nan")
        raise RuntimeError("grader crashed")


def test_score_safely_turns_failures_into_zero_reward():
    failed = score_safely(Exploding(), {}, "anything")
    assert failed.failed and failed.reward == 0.0 and "grader crashed" in failed.error
    nan = score_safely(Exploding(), {}, "nan")
    assert nan.failed and nan.reward == 0.0


@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None, reason="reasoning-gym not installed")
def test_reasoning_gym_procedural_tasks():
    env = build_environment(ReasoningGymEnvConfig(name="basic_arithmetic", size=20, seed=1))
    tasks = env.sample_tasks(4, np.random.default_rng(0))
    for task in tasks:
        entry = env.dataset[task["index"]]
        assert entry["question"] in env.build_prompt(task)[-1]["content"]
        assert env.score(task, str(entry["answer"])) == 1.0
        assert env.score(task, "definitely wrong") == 0.0
