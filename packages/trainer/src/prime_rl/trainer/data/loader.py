"""Step-indexed data loading: `loader.micro_batches(step)` is this rank's share of optimizer step `step`.

Every rank derives the same global sequence of packed rows (SFT: shuffled per epoch with
`seed + epoch`, then packed; fake: row g drawn from `seed + g`), and step s uses rows
[s * batch_size, (s + 1) * batch_size). Rank r takes a contiguous slice, cut into micro-batches of
`micro_batch_size` rows concatenated into one [1, micro_batch_size * seq_len] sequence (positions
restart per sample, so rows never attend to each other). Being a pure function of the step, it needs
no state in checkpoints, and one process sees exactly the rows that N processes see together.
"""

from dataclasses import dataclass
from typing import Any

import torch

from prime_rl.common.config.trainer import FakeDataConfig, SFTDataConfig
from prime_rl.trainer.data.fake import fake_samples
from prime_rl.trainer.data.packing import IGNORE_INDEX, Row, Sample, pack_samples
from prime_rl.trainer.data.sft import load_sft_samples


@dataclass
class SFTMicroBatch:
    """One forward pass: tensors of shape (1, T), T = micro_batch_size * seq_len."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor

    @property
    def num_loss_tokens(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())

    def to(self, device: torch.device) -> "SFTMicroBatch":
        return SFTMicroBatch(
            *(t.to(device, non_blocking=True) for t in (self.input_ids, self.position_ids, self.targets))
        )


def num_micro_batches(batch_size: int, micro_batch_size: int, dp_world: int) -> int:
    """Micro-batches per rank per step; raises if the batch does not split evenly."""
    if batch_size % (micro_batch_size * dp_world):
        raise ValueError(
            f"data.batch_size={batch_size} must be a multiple of data.micro_batch_size={micro_batch_size} x "
            f"{dp_world} data-parallel ranks = {micro_batch_size * dp_world}; change batch_size or micro_batch_size"
        )
    return batch_size // (micro_batch_size * dp_world)


class DataLoader:
    def __init__(
        self,
        cfg: SFTDataConfig | FakeDataConfig,
        dp_rank: int,
        dp_world: int,
        vocab_size: int,
        samples: list[Sample] | None = None,
        pad_id: int = 0,
    ):
        self.cfg = cfg
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.vocab_size = vocab_size
        self.pad_id = pad_id
        self.num_micro_batches = num_micro_batches(cfg.batch_size, cfg.micro_batch_size, dp_world)
        self._samples = samples
        self._epoch: int | None = None
        self._epoch_rows: list[Row] = []
        if isinstance(cfg, SFTDataConfig):
            assert samples, "SFT data needs tokenized samples"
            self.rows_per_epoch = len(self._pack_epoch(0))

    def micro_batches(self, step: int) -> list[SFTMicroBatch]:
        """This rank's micro-batches for optimizer step `step` (0-based)."""
        per_rank = self.cfg.batch_size // self.dp_world
        first = step * self.cfg.batch_size + self.dp_rank * per_rank
        rows = [self._row(first + i) for i in range(per_rank)]
        mbs = self.cfg.micro_batch_size
        return [_concat(rows[i : i + mbs]) for i in range(0, per_rank, mbs)]

    def _row(self, index: int) -> Row:
        if isinstance(self.cfg, FakeDataConfig):
            gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + index)
            samples = fake_samples(self.cfg, self.vocab_size, self.cfg.seq_len, gen)
            (row,) = pack_samples(samples, self.cfg.seq_len, self.pad_id)
            return row
        epoch, offset = divmod(index, self.rows_per_epoch)
        if epoch != self._epoch:
            self._epoch_rows, self._epoch = self._pack_epoch(epoch), epoch
        return self._epoch_rows[offset]

    def _pack_epoch(self, epoch: int) -> list[Row]:
        samples = self._samples
        if self.cfg.shuffle:
            gen = torch.Generator().manual_seed(self.cfg.seed + epoch)
            samples = [samples[i] for i in torch.randperm(len(samples), generator=gen).tolist()]
        return pack_samples(samples, self.cfg.seq_len, self.pad_id)


def _concat(rows: list[Row]) -> SFTMicroBatch:
    return SFTMicroBatch(
        input_ids=torch.cat([r.input_ids for r in rows])[None],
        position_ids=torch.cat([r.position_ids for r in rows])[None],
        targets=torch.cat([r.targets for r in rows])[None],
    )


def build_data_loader(
    cfg: SFTDataConfig | FakeDataConfig, tokenizer: Any, vocab_size: int, dp_rank: int, dp_world: int
) -> DataLoader:
    """Tokenize (SFT) and validate everything up front; raises on the first bad sample."""
    num_micro_batches(cfg.batch_size, cfg.micro_batch_size, dp_world)
    if isinstance(cfg, FakeDataConfig):
        return DataLoader(cfg, dp_rank, dp_world, vocab_size)
    samples = load_sft_samples(cfg.path, tokenizer, cfg.seq_len, vocab_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return DataLoader(cfg, dp_rank, dp_world, vocab_size, samples=samples, pad_id=pad_id)
