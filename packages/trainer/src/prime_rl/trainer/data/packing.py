"""Pack variable-length samples into rows of exactly `seq_len` tokens (document masking).

A sample is a token list plus a per-token loss mask. Within a row, each sample keeps its own
positions (0, 1, ...), so the model's attention (which restarts at position 0) never crosses a
sample boundary. Targets are next tokens *within* a sample; the last token of a sample has no
target. The tail of a row is padding: one more "document" with loss mask 0.

Packing is greedy in order (next-fit): it keeps the sample order, so a shuffled order stays
shuffled, and it is deterministic, which makes resume a pure function of the step number.
"""

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100
"""Target id for tokens without a loss (the fused LM head gives them logprob 0)."""


@dataclass
class Sample:
    """One training sample: token ids and a loss mask over the *predicted* tokens."""

    input_ids: list[int]
    loss_mask: list[bool]
    """loss_mask[i]: token i is trained on (predicted from tokens < i). loss_mask[0] is ignored."""


@dataclass
class Row:
    """One packed row of seq_len tokens, as tensors of shape (seq_len,)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor  # next token, or IGNORE_INDEX where no loss is taken


def pack_samples(samples: list[Sample], seq_len: int, pad_id: int = 0) -> list[Row]:
    """Next-fit packing of samples (each <= seq_len tokens) into rows of exactly seq_len tokens."""
    rows: list[Row] = []
    ids: list[int] = []
    pos: list[int] = []
    tgt: list[int] = []
    for sample in samples:
        n = len(sample.input_ids)
        if n > seq_len:
            raise ValueError(
                f"a sample of {n} tokens is longer than data.seq_len={seq_len}; raise data.seq_len or drop/split "
                "long samples"
            )
        if len(ids) + n > seq_len:
            rows.append(_finish_row(ids, pos, tgt, seq_len, pad_id))
            ids, pos, tgt = [], [], []
        ids.extend(sample.input_ids)
        pos.extend(range(n))
        # target of token i is token i+1 if that one carries loss; the sample's last token has none
        tgt.extend(sample.input_ids[i + 1] if sample.loss_mask[i + 1] else IGNORE_INDEX for i in range(n - 1))
        tgt.append(IGNORE_INDEX)
    if ids:
        rows.append(_finish_row(ids, pos, tgt, seq_len, pad_id))
    return rows


def _finish_row(ids: list[int], pos: list[int], tgt: list[int], seq_len: int, pad_id: int) -> Row:
    pad = seq_len - len(ids)
    return Row(
        input_ids=torch.tensor(ids + [pad_id] * pad, dtype=torch.long),
        position_ids=torch.tensor(pos + list(range(pad)), dtype=torch.long),
        targets=torch.tensor(tgt + [IGNORE_INDEX] * pad, dtype=torch.long),
    )
