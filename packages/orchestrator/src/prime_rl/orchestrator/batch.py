"""Turn packed micro-batches into wire messages and ship them: one `TrainingBatch` per rank per step.

Trainer rank r receives exactly its own `TrainingBatch` (its balanced share of micro-batches, each a
`[seq_len]` array set sent as zero-copy frames) on its own PUSH socket bound at `port + r`. One
message per rank keeps every rank's receive independent (no rank-0 scatter inside the trainer).
"""

from __future__ import annotations

import logging

import numpy as np

from prime_rl.common.transport import Sender
from prime_rl.common.wire import TrainingBatch, build_micro_batch
from prime_rl.orchestrator.packing import PackedMicroBatch

logger = logging.getLogger(__name__)


def build_training_batch(
    step: int,
    micro_batches: list[PackedMicroBatch],
    *,
    temperature: float,
    policy_version: int,
    metrics: dict[str, float] | None = None,
) -> tuple[TrainingBatch, dict[str, np.ndarray]]:
    """One rank's TrainingBatch header and its frames (named `mb<i>/<field>`)."""
    headers = []
    arrays: dict[str, np.ndarray] = {}
    for i, mb in enumerate(micro_batches):
        header, frames = build_micro_batch(
            f"mb{i}",
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            loss_mask=mb.loss_mask,
            advantages=mb.advantages,
            inference_logprobs=mb.inference_logprobs,
            temperature=temperature,
        )
        headers.append(header)
        arrays.update(frames)
    batch = TrainingBatch(step=step, policy_version=policy_version, micro_batches=headers, metrics=metrics or {})
    return batch, arrays


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
