"""Ship one `TrainingBatch` per trainer rank per step (built by `prime_rl.common.wire.build_training_batch`).

Trainer rank r receives exactly its own `TrainingBatch` (its balanced share of micro-batches, each a
`[seq_len]` array set sent as zero-copy frames) on its own PUSH socket bound at `port + r`. One
message per rank keeps every rank's receive independent (no rank-0 scatter inside the trainer).
"""

from __future__ import annotations

import logging

import numpy as np

from prime_rl.common.transport import Sender
from prime_rl.common.wire import TrainingBatch

logger = logging.getLogger(__name__)


class BatchSender:
    """One bound ZeroMQ PUSH socket per trainer rank: rank r connects to tcp://address:(port + r)."""

    def __init__(self, address: str, port: int, num_ranks: int, timeout: float = 3600.0) -> None:
        self.senders = [
            Sender(f"tcp://{address}:{port + rank}", bind=True, timeout_s=timeout) for rank in range(num_ranks)
        ]

    @property
    def endpoints(self) -> list[str]:
        return [s.endpoint for s in self.senders]

    def send(self, per_rank: list[tuple[TrainingBatch, dict[str, np.ndarray]]]) -> None:
        if len(per_rank) != len(self.senders):
            raise ValueError(f"got {len(per_rank)} rank batches for {len(self.senders)} trainer ranks")
        for sender, (batch, arrays) in zip(self.senders, per_rank):
            sender.send(batch, arrays)

    def close(self) -> None:
        for sender in self.senders:
            sender.close()
