import numpy as np
import pytest

from prime_rl.orchestrator.advantages import compute_advantages


def test_group_relative_mean_baseline():
    rewards = np.array([[1.0, 0.0, 0.5, 0.5], [2.0, 2.0, 2.0, 2.0]])
    adv = compute_advantages(rewards)
    np.testing.assert_allclose(adv[0], [0.5, -0.5, 0.0, 0.0])
    np.testing.assert_allclose(adv[1], 0.0)  # equal rewards carry no signal
    np.testing.assert_allclose(adv.sum(axis=1), 0.0, atol=1e-7)
    assert adv.dtype == np.float32


def test_std_normalization():
    rewards = np.array([[1.0, 0.0], [0.2, 0.1]])
    adv = compute_advantages(rewards, std_normalize=True, eps=0.0)
    np.testing.assert_allclose(adv, [[1.0, -1.0], [1.0, -1.0]], rtol=1e-5)
    constant = compute_advantages(np.array([[3.0, 3.0]]), std_normalize=True)
    np.testing.assert_allclose(constant, 0.0)  # eps keeps 0/0 finite


def test_rejects_flat_rewards():
    with pytest.raises(ValueError, match="num_groups, group_size"):
        compute_advantages(np.array([1.0, 2.0]))
