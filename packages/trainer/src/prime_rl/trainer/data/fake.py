"""Fake samples: random tokens with loss on all of them, for benchmarks and tests.

Deterministic in (seed, step, rank), so a resumed run sees the same data as an uninterrupted one.
"""

import torch

from prime_rl.common.config.trainer import FakeDataConfig
from prime_rl.trainer.data.packing import Sample


def fake_samples(cfg: FakeDataConfig, vocab_size: int, num_tokens: int, generator: torch.Generator) -> list[Sample]:
    """Random samples totalling `num_tokens` tokens (the last one cut to fit)."""
    lo = cfg.min_sample_len or cfg.seq_len
    hi = cfg.max_sample_len or cfg.seq_len
    samples = []
    left = num_tokens
    while left > 0:
        n = int(torch.randint(lo, hi + 1, (1,), generator=generator)) if hi > lo else hi
        n = min(n, left)
        ids = torch.randint(0, vocab_size, (n,), generator=generator).tolist()
        samples.append(Sample(input_ids=ids, loss_mask=[True] * n))
        left -= n
    return samples
