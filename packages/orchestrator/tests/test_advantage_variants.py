"""[orchestrator.advantage] variants against closed forms: leave-one-out, length shaping, the default unchanged."""

import numpy as np
import pytest
from pydantic import ValidationError

from prime_rl.common.config.orchestrator import AdvantageConfig, OrchestratorConfig
from prime_rl.orchestrator.advantages import (
    compute_advantages,
    group_advantages,
    leave_one_out_advantages,
    overlong_penalties,
)


def test_default_is_bit_identical_to_the_group_mean():
    rng = np.random.default_rng(0)
    for _ in range(50):
        rewards = rng.random(8) * rng.integers(1, 4)
        for std in (False, True):
            adv, pen = group_advantages(rewards, rng.integers(1, 64, 8), max_tokens=64, std_normalize=std)
            assert np.array_equal(adv, compute_advantages(rewards[None], std)[0])
            assert adv.dtype == np.float32
            assert not pen.any()


def test_leave_one_out_closed_form():
    # n = 4, rewards 1, 0, 0, 1: the baseline of a 1 is (0 + 0 + 1) / 3, of a 0 it is (1 + 0 + 1) / 3
    adv = leave_one_out_advantages(np.array([[1.0, 0.0, 0.0, 1.0]]))
    np.testing.assert_allclose(adv[0], [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)
    # == n / (n - 1) * (r - mean) in general
    rewards = np.array([[0.3, 0.9, 0.1], [2.0, 2.0, 2.0]])
    expected = 3 / 2 * (rewards - rewards.mean(axis=1, keepdims=True))
    np.testing.assert_allclose(leave_one_out_advantages(rewards), expected, rtol=1e-6, atol=1e-7)
    # std normalization divides by the group's std like the mean baseline does
    std = leave_one_out_advantages(np.array([[1.0, 0.0]]), std_normalize=True, eps=0.0)
    np.testing.assert_allclose(std, [[2.0, -2.0]], rtol=1e-6)  # (1 - 0) / 0.5, (0 - 1) / 0.5
    with pytest.raises(ValueError, match="group_size >= 2"):
        leave_one_out_advantages(np.array([[1.0]]))


def test_overlong_penalty_is_a_linear_ramp_over_the_window():
    # max_tokens 10, window 4: free up to 6 tokens, then 1/4 per token, full penalty at 10
    pen = overlong_penalties(np.array([1, 6, 7, 8, 9, 10]), max_tokens=10, window=4, penalty=0.5)
    np.testing.assert_allclose(pen, 0.5 * np.array([0, 0, 0.25, 0.5, 0.75, 1.0]))
    assert not overlong_penalties(np.array([10, 10]), max_tokens=10, window=0).any()
    with pytest.raises(ValueError, match="overlong_window=11 must be <= max_tokens=10"):
        overlong_penalties(np.array([1]), max_tokens=10, window=11)


def test_length_shaping_is_applied_before_the_baseline():
    # equal task rewards, one completion 2 tokens, one truncated at max_tokens: shaped rewards 1 and 0
    adv, pen = group_advantages([1.0, 1.0], [2, 10], max_tokens=10, overlong_window=4)
    np.testing.assert_allclose(pen, [0.0, 1.0])
    np.testing.assert_allclose(adv, [0.5, -0.5])
    # with leave-one-out: shaped rewards 1, 0.5 (8 tokens), 0 -> r - mean(others)
    adv, _ = group_advantages([1, 1, 1], [2, 8, 10], max_tokens=10, overlong_window=4, baseline="leave_one_out")
    np.testing.assert_allclose(adv, [1 - 0.25, 0.5 - 0.5, 0 - 0.75], atol=1e-7)


def test_config_defaults_and_bad_window():
    cfg = AdvantageConfig()
    assert (cfg.baseline, cfg.overlong_window, cfg.std_normalize) == ("mean", 0, False)
    with pytest.raises(ValidationError, match="advantage.overlong_window=9 must be <= sampling.max_tokens=8"):
        OrchestratorConfig.model_validate({"sampling": {"max_tokens": 8}, "advantage": {"overlong_window": 9}})
    with pytest.raises(ValidationError, match="baseline"):
        AdvantageConfig(baseline="median")
