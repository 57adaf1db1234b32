"""Group-relative advantages (GRPO style): each completion is judged against its siblings.

A_i = r_i - mean(r_group), optionally divided by std(r_group) + eps. Without std normalization
(the default, as in Dr. GRPO) groups whose rewards barely differ do not get their noise blown up.
A group whose rewards are all equal has zero advantage everywhere: it carries no signal.
"""

from __future__ import annotations

import numpy as np


def compute_advantages(rewards: np.ndarray, std_normalize: bool = False, eps: float = 1e-6) -> np.ndarray:
    """Advantages for rewards shaped (num_groups, group_size); returns float32 of the same shape."""
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be (num_groups, group_size), got shape {rewards.shape}")
    advantages = rewards - rewards.mean(axis=1, keepdims=True)  # (G, n)
    if std_normalize:
        advantages = advantages / (rewards.std(axis=1, keepdims=True) + eps)
    return advantages.astype(np.float32)


# --- [orchestrator.advantage] variants -------------------------------------------------------------
#
# Baselines, for a group of n rewards r:
#   "mean"           A_i = r_i - mean(r)                          (GRPO / Dr. GRPO; the default)
#   "leave_one_out"  A_i = r_i - mean_{j != i} r_j = n/(n-1) * (r_i - mean(r))   (RLOO: the baseline
#                    does not contain the sample's own reward, so the estimate is unbiased)
# either optionally divided by std(r) + eps (the same std for both, so std_normalize means the same).
#
# Length shaping (DAPO's soft overlong punishment), applied to the reward before the baseline:
#   r_i <- r_i - penalty * clip((len_i - (max_tokens - window)) / window, 0, 1)
# i.e. nothing below the last `window` tokens before max_tokens, then a linear ramp to `penalty` at
# max_tokens (a truncated completion gets the full penalty). The task reward the run logs as
# reward/* stays the environment's; the penalty is logged apart (advantage/length_penalty_*).


def leave_one_out_advantages(rewards: np.ndarray, std_normalize: bool = False, eps: float = 1e-6) -> np.ndarray:
    """RLOO advantages for rewards shaped (num_groups, group_size >= 2); float32 of the same shape."""
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be (num_groups, group_size >= 2), got shape {rewards.shape}")
    n = rewards.shape[1]
    others_mean = (rewards.sum(axis=1, keepdims=True) - rewards) / (n - 1)  # (G, n)
    advantages = rewards - others_mean
    if std_normalize:
        advantages = advantages / (rewards.std(axis=1, keepdims=True) + eps)
    return advantages.astype(np.float32)


def overlong_penalties(completion_lens: np.ndarray, max_tokens: int, window: int, penalty: float = 1.0) -> np.ndarray:
    """DAPO soft overlong penalty per completion (>= 0, subtract it from the reward); zeros when window is 0."""
    lens = np.asarray(completion_lens, dtype=np.float64)
    if window <= 0:
        return np.zeros_like(lens)
    if window > max_tokens:
        raise ValueError(f"overlong_window={window} must be <= max_tokens={max_tokens}")
    return penalty * np.clip((lens - (max_tokens - window)) / window, 0.0, 1.0)


def group_advantages(
    rewards: list[float] | np.ndarray,
    completion_lens: list[int] | np.ndarray,
    *,
    max_tokens: int,
    baseline: str = "mean",
    std_normalize: bool = False,
    eps: float = 1e-6,
    overlong_window: int = 0,
    overlong_penalty: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """One group's (advantages, length penalties), both float32 (group_size,).

    With the defaults this is exactly `compute_advantages` (no length term is added at all)."""
    shaped = np.asarray(rewards, dtype=np.float64)
    penalties = overlong_penalties(np.asarray(completion_lens), max_tokens, overlong_window, overlong_penalty)
    if overlong_window > 0:
        shaped = shaped - penalties
    if baseline == "mean":
        advantages = compute_advantages(shaped[None], std_normalize, eps)[0]
    elif baseline == "leave_one_out":
        advantages = leave_one_out_advantages(shaped[None], std_normalize, eps)[0]
    else:
        raise ValueError(f"advantage.baseline={baseline!r} is not one of 'mean', 'leave_one_out'")
    return advantages, penalties.astype(np.float32)
