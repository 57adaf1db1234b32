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
