"""Forwards sized in tokens: received rows are trimmed, then concatenated up to `data.micro_batch_tokens`.

Why: the orchestrator packs samples into rows of `seq_len` tokens padded to `seq_len`. With 1,050-token
samples in 2,048-token rows each row holds one sample, about half of every forward is padding, and one
2,048-token forward is far too little work for a GPU (H200, Qwen3-1.7B shape: 7-12k tokens/s on such rows
against 33k on 8k-token rows, issue 29). So on arrival:

1. **Trim.** A row is cut after the sample that holds its last loss position. What follows cannot change
   anything: attention is causal and positions restart per sample, so no kept position sees it; every
   statistic (loss, entropy, mismatch KL, masked fractions, KL to the reference) is masked by `loss_mask`,
   and the sample counts of the "sequence" / "constant" normalizations count samples with a loss token.
   A row with no loss token (the orchestrator's balancing rows) is dropped.
2. **Concatenate.** Consecutive rows of the same temperature are laid back to back while the forward stays
   within the budget (a row longer than the budget is its own forward). Each row starts at position 0, so
   the varlen attention keeps every sample to itself, exactly as in its own row.
3. **Round up.** Each forward is padded to a multiple of `lcm(LENGTH_QUANTUM, cp)` tokens with a padding run
   (token 0, positions from 0, no loss): context parallelism cuts a forward into cp equal slices, and
   torch.compile sees a bounded number of lengths (budget / 128 at most) instead of one per step.
4. **Equalize.** FSDP (and EP, CP) run collectives in every forward and backward, so every rank must run as
   many forwards: ranks with fewer get padding-only forwards of one quantum (their loss is 0, their gradient
   0). The counts meet on a gloo group on the host, before the step, so the device never waits for it.

`RLMicroBatch.num_real_tokens` keeps the trimmed rows' length (padding excluded): throughput counts those.
Left out: reordering rows to fill forwards better (first-fit decreasing): the orchestrator's rows arrive
already balanced, and consecutive packing keeps the row order, which keeps the result reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from prime_rl.trainer.rl.data import IGNORE_INDEX, RLMicroBatch

LENGTH_QUANTUM = 128
"""Forwards are padded to a multiple of this many tokens (times cp): at most budget / 128 compiled lengths."""


def live_length(row: RLMicroBatch) -> int:
    """Tokens up to the end of the sample holding the row's last loss position; 0 if it has no loss token."""
    loss = row.loss_mask.nonzero()
    if loss.numel() == 0:
        return 0
    last = int(loss[-1])
    starts = (row.position_ids.flatten()[last + 1 :] == 0).nonzero()
    return last + 1 + int(starts[0]) if starts.numel() else row.input_ids.shape[-1]


def _cut(row: RLMicroBatch, n: int) -> RLMicroBatch:
    keep = lambda t: None if t is None else t[..., :n]  # noqa: E731
    return RLMicroBatch(
        keep(row.input_ids), keep(row.position_ids), keep(row.targets), keep(row.loss_mask), keep(row.advantages),
        keep(row.inference_logprobs), row.temperature, n, None if row.routed_experts is None else row.routed_experts[:n],
    )  # fmt: skip


def padding_run(n: int, temperature: float = 1.0, on_policy: bool = True) -> RLMicroBatch:
    """``n`` padding tokens: token 0, positions 0..n-1, no target, no loss (``on_policy``: no inference logprobs)."""
    return RLMicroBatch(
        input_ids=torch.zeros(1, n, dtype=torch.int64),
        position_ids=torch.arange(n, dtype=torch.int64)[None],
        targets=torch.full((n,), IGNORE_INDEX, dtype=torch.int64),
        loss_mask=torch.zeros(n, dtype=torch.bool),
        advantages=torch.zeros(n, dtype=torch.float32),
        inference_logprobs=None if on_policy else torch.zeros(n, dtype=torch.float32),
        temperature=temperature,
        num_real_tokens=0,
    )


def concat(rows: Sequence[RLMicroBatch], multiple: int = 1) -> RLMicroBatch:
    """Rows of one temperature back to back, padded to a multiple of ``multiple`` tokens."""
    real = sum(r.real_tokens for r in rows)
    length = sum(r.input_ids.shape[-1] for r in rows)
    on_policy = rows[0].inference_logprobs is None
    if any((r.inference_logprobs is None) != on_policy for r in rows):
        raise ValueError("cannot concatenate on-policy rows (no inference logprobs) with off-policy ones")
    pad = -length % multiple
    parts = [*rows, padding_run(pad, rows[0].temperature, on_policy)] if pad else list(rows)
    cat = lambda name, dim: torch.cat([getattr(r, name) for r in parts], dim)  # noqa: E731
    return RLMicroBatch(
        input_ids=cat("input_ids", 1),
        position_ids=cat("position_ids", 1),
        targets=cat("targets", 0),
        loss_mask=cat("loss_mask", 0),
        advantages=cat("advantages", 0),
        inference_logprobs=None if on_policy else cat("inference_logprobs", 0),
        temperature=rows[0].temperature,
        num_real_tokens=real,
        routed_experts=concat_routed_experts(parts),
    )


def concat_routed_experts(rows: Sequence[RLMicroBatch]) -> torch.Tensor | None:
    """The rows' routed experts back to back, -1 (the trainer routes) for rows without; None if no row has any."""
    shapes = {r.routed_experts.shape[1:] for r in rows if r.routed_experts is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"rows carry routed experts of different (layers, top_k): {sorted(shapes)}")
    (shape,) = shapes
    none = lambda r: torch.full((r.input_ids.shape[-1], *shape), -1, dtype=torch.int16)  # noqa: E731
    return torch.cat([none(r) if r.routed_experts is None else r.routed_experts for r in rows])


def build_forwards(rows: Sequence[RLMicroBatch], budget: int, multiple: int = LENGTH_QUANTUM) -> list[RLMicroBatch]:
    """Trim each row, then concatenate consecutive rows of one temperature into forwards of at most ``budget``
    tokens after rounding up to ``multiple`` (a row longer than that is its own forward)."""
    forwards: list[RLMicroBatch] = []
    current: list[RLMicroBatch] = []
    length = 0
    for row in rows:
        n = live_length(row)
        if n == 0:
            continue
        row = _cut(row, n)
        if current and (
            row.temperature != current[0].temperature
            or (row.inference_logprobs is None) != (current[0].inference_logprobs is None)
            or math.ceil((length + n) / multiple) * multiple > budget
        ):
            forwards.append(concat(current, multiple))
            current, length = [], 0
        current.append(row)
        length += n
    if current:
        forwards.append(concat(current, multiple))
    return forwards


def with_live_lengths(rows: Sequence[RLMicroBatch]) -> list[RLMicroBatch]:
    """Rows as received (one forward each, untrimmed) with ``num_real_tokens`` set, so throughput means the same."""
    out = []
    for row in rows:
        row = _cut(row, row.input_ids.shape[-1])
        row.num_real_tokens = live_length(row)
        out.append(row)
    return out


class TokenBudgetSource:
    """Wraps a batch source: every step's rows become forwards of about ``budget`` tokens (see the module
    docstring); ``budget`` None keeps one forward per received row."""

    def __init__(self, source, budget: int | None, cp: int = 1):  # noqa: ANN001 - any BatchSource of RL rows
        self.source, self.budget = source, budget
        self.multiple = math.lcm(LENGTH_QUANTUM, cp)
        world = dist.get_world_size() if dist.is_initialized() else 1
        # the forward counts meet on the host: a gloo group beside the (NCCL) training group
        self.group = dist.new_group(backend="gloo") if budget is not None and world > 1 else None

    def get(self, step: int) -> list[RLMicroBatch]:
        rows = self.source.get(step)
        if self.budget is None:
            return with_live_lengths(rows)
        forwards = build_forwards(rows, self.budget, self.multiple)
        count = torch.tensor([len(forwards)], dtype=torch.int64)
        if self.group is not None:
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        # at least one forward: a step with no loss token anywhere still runs FSDP's collectives once
        forwards += [padding_run(self.multiple) for _ in range(max(int(count), 1) - len(forwards))]
        return forwards

    def close(self) -> None:
        self.source.close()
