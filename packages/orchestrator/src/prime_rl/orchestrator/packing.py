"""Pack samples into fixed `[seq_len]` micro-batches and balance them across trainer ranks.

Layout of one micro-batch (all arrays `[seq_len]`, aligned with `input_ids`, i.e. the value at
index i belongs to token `input_ids[i]`; the trainer shifts logits to predict token i from i - 1):
- samples sit back to back (prompt then completion); `position_ids` restart at 0 at every
  sample start, which is how the trainer recovers document boundaries (varlen attention);
- the tail is padding: token 0, its own run of positions 0, 1, ..., loss_mask False;
- `loss_mask` is True on completion tokens only (multi-turn: on sampled tokens only, not on the
  environment's messages between turns); `advantages` carry the sample's advantage on them (0
  elsewhere); `inference_logprobs` the sampler's logprob of each completion token (0 elsewhere);
- with `orchestrator.routed_experts`, `routed_experts` `(seq_len, layers, top_k)` holds the experts inference
  routed each token to (prompt and completion; -1 on padding and on each sample's last token).

Packing is first-fit decreasing (few bins, a handful of percent padding on mixed lengths).
Balancing gives every rank the same number of micro-batches (an all-zero, zero-loss micro-batch
fills the gap) and assigns the heaviest remaining micro-batch to the least-loaded rank that
still has room, so token counts per rank end up close.

Packing never splits or cuts a sample: one longer than `seq_len` is dropped whole, its index
returned so the caller can name it (`batch/dropped_overlong`). Cutting its completion would train on
text the reward was not computed for, and on a sample of a length vLLM never produced. In `rl`
none gets here: vLLM's `max_model_len` is at most `seq_len` and multi-turn rollouts stop at both; a
standalone orchestrator whose server allows longer samples than `seq_len` can meet them. Samples with
no completion token are skipped (counted as `empty`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from prime_rl.orchestrator.rollout import Sample


@dataclass
class PackedMicroBatch:
    input_ids: np.ndarray  # (seq_len,) int32
    position_ids: np.ndarray  # (seq_len,) int32
    loss_mask: np.ndarray  # (seq_len,) bool
    advantages: np.ndarray  # (seq_len,) float32
    inference_logprobs: np.ndarray  # (seq_len,) float32
    num_samples: int
    num_tokens: int  # tokens that belong to samples (the rest is padding)
    routed_experts: np.ndarray | None = (
        None  # (seq_len, layers, top_k) int16, -1 = none reported; None = no sample has any
    )

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def fields(self) -> dict[str, np.ndarray]:
        """The arrays `prime_rl.common.wire.build_training_batch` sends, by field name (five, plus the routed
        experts when a sample carried them)."""
        fields = {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "loss_mask": self.loss_mask,
            "advantages": self.advantages,
            "inference_logprobs": self.inference_logprobs,
        }
        if self.routed_experts is not None:
            fields["routed_experts"] = self.routed_experts
        return fields


@dataclass
class PackingStats:
    num_samples: int = 0
    dropped_overlong: list[int] = field(default_factory=list)
    """Indices (into the packed samples) of samples longer than seq_len, dropped whole."""
    num_empty: int = 0
    num_micro_batches: int = 0
    num_padding_micro_batches: int = 0
    num_tokens: int = 0

    def metrics(self, seq_len: int) -> dict[str, float]:
        capacity = max(1, self.num_micro_batches * seq_len)
        return {
            "batch/dropped_overlong": float(len(self.dropped_overlong)),
            "packing/empty": float(self.num_empty),
            "packing/micro_batches": float(self.num_micro_batches),
            "packing/padding_micro_batches": float(self.num_padding_micro_batches),
            "packing/fill": self.num_tokens / capacity,
        }


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins whose sums stay <= capacity (each length <= capacity)."""
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > capacity:
            raise ValueError(f"item {i} has length {lengths[i]} > capacity {capacity}; fit it first")
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


def balance_across_ranks(loads: list[int], num_ranks: int) -> list[list[int]]:
    """Assign items (given their loads) to ranks: equal counts (len(loads) must divide evenly), similar load sums."""
    if len(loads) % num_ranks:
        raise ValueError(f"{len(loads)} micro-batches cannot be split evenly over {num_ranks} ranks; pad first")
    per_rank = len(loads) // num_ranks
    assignment: list[list[int]] = [[] for _ in range(num_ranks)]
    totals = [0] * num_ranks
    for i in sorted(range(len(loads)), key=lambda i: -loads[i]):
        open_ranks = [r for r in range(num_ranks) if len(assignment[r]) < per_rank]
        r = min(open_ranks, key=lambda r: (totals[r], r))
        assignment[r].append(i)
        totals[r] += loads[i]
    return assignment


def empty_micro_batch(seq_len: int) -> PackedMicroBatch:
    """A micro-batch that trains on nothing: one padding run, loss_mask all False."""
    return PackedMicroBatch(
        input_ids=np.zeros(seq_len, dtype=np.int32),
        position_ids=np.arange(seq_len, dtype=np.int32),
        loss_mask=np.zeros(seq_len, dtype=np.bool_),
        advantages=np.zeros(seq_len, dtype=np.float32),
        inference_logprobs=np.zeros(seq_len, dtype=np.float32),
        num_samples=0,
        num_tokens=0,
    )


def _put_routed_experts(mb: PackedMicroBatch, experts: np.ndarray, start: int, num_tokens: int) -> None:
    """Write a sample's routed experts (one row per token but its last, which inference never forwarded) at
    ``start``; the rest of the row stays -1 (none reported: the trainer routes those tokens itself)."""
    if mb.routed_experts is None:
        mb.routed_experts = np.full((len(mb.input_ids), *experts.shape[1:]), -1, dtype=np.int16)
    elif mb.routed_experts.shape[1:] != experts.shape[1:]:
        raise ValueError(
            f"routed experts of shape (layers, top_k)={experts.shape[1:]} beside {mb.routed_experts.shape[1:]} in "
            "one micro-batch; every rollout must come from the same model"
        )
    n = min(len(experts), num_tokens)
    mb.routed_experts[start : start + n] = experts[:n]


def pack_row(samples: list[Sample], seq_len: int) -> PackedMicroBatch:
    """Lay `samples` (which must fit together) back to back into one `[seq_len]` micro-batch."""
    mb = empty_micro_batch(seq_len)
    start = 0
    for s in samples:
        n_prompt, n_total = len(s.prompt_ids), s.num_tokens
        end = start + n_total
        if end > seq_len:
            raise ValueError(f"samples need {end}+ tokens but seq_len={seq_len}")
        mb.input_ids[start : start + n_prompt] = s.prompt_ids
        mb.input_ids[start + n_prompt : end] = s.completion_ids
        mb.position_ids[start:end] = np.arange(n_total, dtype=np.int32)
        mb.loss_mask[start + n_prompt : end] = True if s.completion_mask is None else s.completion_mask
        mb.advantages[start + n_prompt : end] = s.advantage
        if s.token_advantages is not None:  # per-token terms (distillation) on top of the sample's advantage
            mb.advantages[start + n_prompt : end] += np.asarray(s.token_advantages, dtype=np.float32)
        mb.advantages[start:end] *= mb.loss_mask[start:end]  # multi-turn: 0 on tokens nobody sampled
        mb.inference_logprobs[start + n_prompt : end] = s.completion_logprobs
        if s.routed_experts is not None:
            _put_routed_experts(mb, s.routed_experts, start, n_total)
        start = end
    # Padding is its own "document" so it never attends into (or is attended by) a real sample.
    mb.position_ids[start:] = np.arange(seq_len - start, dtype=np.int32)
    mb.num_samples, mb.num_tokens = len(samples), start
    return mb


def pack_batch(
    samples: list[Sample], seq_len: int, num_ranks: int
) -> tuple[list[list[PackedMicroBatch]], PackingStats]:
    """Pack one step's samples: returns micro-batches per rank (equal counts, >= 1 each) and stats. A sample
    longer than ``seq_len`` is left out whole; its index is in ``stats.dropped_overlong``."""
    stats = PackingStats(num_samples=len(samples))
    fitted: list[Sample] = []
    for i, sample in enumerate(samples):
        if not sample.completion_ids:
            stats.num_empty += 1
        elif sample.num_tokens > seq_len:
            stats.dropped_overlong.append(i)
        else:
            fitted.append(sample)
    bins = first_fit_decreasing([s.num_tokens for s in fitted], seq_len)
    micro_batches = [pack_row([fitted[i] for i in b], seq_len) for b in bins]
    per_rank = max(1, -(-len(micro_batches) // num_ranks))
    num_padding = per_rank * num_ranks - len(micro_batches)
    micro_batches += [empty_micro_batch(seq_len) for _ in range(num_padding)]
    assignment = balance_across_ranks([mb.num_tokens for mb in micro_batches], num_ranks)
    stats.num_micro_batches = len(micro_batches)
    stats.num_padding_micro_batches = num_padding
    stats.num_tokens = sum(mb.num_tokens for mb in micro_batches)
    return [[micro_batches[i] for i in ranks] for ranks in assignment], stats
