"""Where RL micro-batches come from: the orchestrator over ZeroMQ, or fake rows for benchmarks.

A micro-batch row holds packed samples in the orchestrator's convention: per token t, ``loss_mask[t]``
and ``inference_logprobs[t]`` refer to token t itself (its logprob given the tokens before it). The
model's LM head predicts token t+1 from position t, so on arrival every per-token array is shifted to
*positions*: ``targets[t]``, ``loss_mask[t]``, ``advantages[t]`` and ``inference_logprobs[t]`` all
describe token t+1 (nothing at a sample's last position). Aligned this way, a micro-batch can be cut
into contiguous context-parallel slices with no value crossing a slice boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from prime_rl.common.config.rl_trainer import FakeRLDataConfig
from prime_rl.common.transport import Receiver
from prime_rl.common.wire import TrainingBatch, micro_batch_arrays
from prime_rl.trainer.parallel.context import shard_sequence

IGNORE_INDEX = -100


@dataclass
class RLMicroBatch:
    input_ids: torch.Tensor  # (1, T) int64
    position_ids: torch.Tensor  # (1, T) int64
    targets: torch.Tensor  # (T,) int64: token t+1 of the same sample, or IGNORE_INDEX
    loss_mask: torch.Tensor  # (T,) bool: token t+1 is trained on
    advantages: torch.Tensor  # (T,) fp32, of token t+1
    inference_logprobs: torch.Tensor | None  # (T,) fp32, of token t+1; None = on-policy (fake data)
    temperature: float
    num_real_tokens: int | None = None
    """Positions that belong to samples (not padding) in the whole forward; None: all of them."""

    @property
    def real_tokens(self) -> int:
        return self.input_ids.shape[-1] if self.num_real_tokens is None else self.num_real_tokens

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def sample_ids(self) -> torch.Tensor:
        """(T,) int64: the index of the packed sample each position belongs to (positions restart at 0).

        A context-parallel slice may start inside a sample: its leading positions count as sample 0."""
        return ((self.position_ids.flatten() == 0).cumsum(0) - 1).clamp(min=0)

    @property
    def num_loss_samples(self) -> int:
        """Samples with at least one loss token (the unit of the "sequence" and "constant" normalizations)."""
        ids = self.sample_ids()
        if ids.numel() == 0:
            return 0
        per_sample = torch.bincount(ids.cpu(), weights=self.loss_mask.cpu().double())
        return int((per_sample > 0).sum())

    def shard(self, cp_rank: int, cp: int) -> RLMicroBatch:
        """This context-parallel rank's contiguous 1/cp slice (positions are already aligned)."""
        cut = lambda t: None if t is None else shard_sequence(t, cp_rank, cp)  # noqa: E731
        return RLMicroBatch(
            cut(self.input_ids),
            cut(self.position_ids),
            cut(self.targets),
            cut(self.loss_mask),
            cut(self.advantages),
            cut(self.inference_logprobs),
            self.temperature,
            self.num_real_tokens,
        )

    def to(self, device: torch.device) -> RLMicroBatch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return RLMicroBatch(
            move(self.input_ids),
            move(self.position_ids),
            move(self.targets),
            move(self.loss_mask),
            move(self.advantages),
            move(self.inference_logprobs),
            self.temperature,
            self.num_real_tokens,
        )


def next_token_targets(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """(T,) -> (T,): input_ids[t+1] where token t+1 is in the same sample, else IGNORE_INDEX."""
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    same_sample = position_ids[1:] != 0  # (T-1,)
    targets[:-1] = torch.where(same_sample, input_ids[1:], torch.full_like(input_ids[1:], IGNORE_INDEX))
    return targets


def to_positions(per_token: torch.Tensor, targets: torch.Tensor, fill: float | bool) -> torch.Tensor:
    """(T,) values about token t -> (T,) values about token t+1 (``fill`` where there is no next token)."""
    out = torch.full_like(per_token, fill)
    out[:-1] = per_token[1:]
    return torch.where(targets != IGNORE_INDEX, out, torch.full_like(out, fill))


def from_arrays(arrays: dict[str, np.ndarray], temperature: float) -> RLMicroBatch:
    ids = torch.from_numpy(arrays["input_ids"].astype(np.int64)).flatten()
    pos = torch.from_numpy(arrays["position_ids"].astype(np.int64)).flatten()
    targets = next_token_targets(ids, pos)
    tensor = lambda name: torch.from_numpy(np.ascontiguousarray(arrays[name])).flatten()  # noqa: E731
    return RLMicroBatch(
        input_ids=ids[None],
        position_ids=pos[None],
        targets=targets,
        loss_mask=to_positions(tensor("loss_mask"), targets, False),
        advantages=to_positions(tensor("advantages"), targets, 0.0),
        inference_logprobs=to_positions(tensor("inference_logprobs"), targets, 0.0),
        temperature=temperature,
    )


class OrchestratorSource:
    """Data-parallel rank r pulls its own TrainingBatch per step from ``tcp://host:(port + r)``."""

    def __init__(self, host: str, port: int, rank: int, timeout_s: float):
        self.receiver = Receiver(f"tcp://{host}:{port + rank}", bind=False, timeout_s=timeout_s, types=(TrainingBatch,))

    def get(self, step: int) -> list[RLMicroBatch]:
        message, arrays = self.receiver.recv()
        assert isinstance(message, TrainingBatch)
        if message.step != step:
            raise RuntimeError(
                f"received the orchestrator's batch for step {message.step} while training step {step}: "
                "trainer and orchestrator disagree on the step; resume both from the same checkpoint step"
            )
        return [from_arrays(micro_batch_arrays(mb, arrays), mb.temperature) for mb in message.micro_batches]

    def close(self) -> None:
        self.receiver.close()


class FakeSource:
    """Random rows of ``seq_len`` tokens; each rank gets ``batch_size / dp`` rows per step.

    With ``generate_samples`` a row packs several samples (random lengths, or ``doc_len`` each with the
    last cut to fill the row); otherwise one sample fills the row. Every token but a sample's first is
    a loss token; advantages are random; the loss runs on-policy (no inference logprobs).
    """

    def __init__(self, cfg: FakeRLDataConfig, seq_len: int, vocab_size: int, rank: int, dp: int):
        if cfg.batch_size % dp:
            raise ValueError(
                f"data.fake.batch_size={cfg.batch_size} must be divisible by the {dp} data-parallel ranks; "
                f"use {max(1, cfg.batch_size // dp) * dp}"
            )
        self.cfg, self.seq_len, self.vocab_size, self.rank, self.dp = cfg, seq_len, vocab_size, rank, dp

    def _lengths(self, g: torch.Generator) -> list[int]:
        if not self.cfg.generate_samples:
            return [self.seq_len]
        lengths, left = [], self.seq_len
        while left > 0:
            n = self.cfg.doc_len or int(torch.randint(2, max(3, self.seq_len // 2), (1,), generator=g))
            lengths.append(min(n, left))
            left -= lengths[-1]
        return lengths

    def get(self, step: int) -> list[RLMicroBatch]:
        rows = self.cfg.batch_size // self.dp
        out = []
        for i in range(rows):
            g = torch.Generator().manual_seed(hash((self.cfg.seed, step, self.rank, i)) % 2**31)
            ids = torch.randint(0, self.vocab_size, (self.seq_len,), generator=g)
            pos = torch.cat([torch.arange(n) for n in self._lengths(g)])
            targets = next_token_targets(ids, pos)
            out.append(
                RLMicroBatch(
                    input_ids=ids[None],
                    position_ids=pos[None],
                    targets=targets,
                    loss_mask=targets != IGNORE_INDEX,
                    advantages=torch.randn(self.seq_len, generator=g),
                    inference_logprobs=None,
                    temperature=1.0,
                )
            )
        return out

    def close(self) -> None:
        pass
