"""Document boundaries of a packed micro-batch, derived once per forward from position_ids.

The orchestrator packs samples into one row and restarts positions at 0 for each sample, so a
document starts wherever `position_ids == 0` (and at the start of every row). Every attention
backend reads the same `PackedSeqs`; backend-specific masks are built lazily and cached on it so
all layers of one forward share them.

Build it on the host (`PackedSeqs.from_position_ids(cpu_position_ids).to(device)`) and pass it to the
model's forward as `seqs=`: the boundaries need host ints (document count, longest document), and
deriving them from device position_ids is a device-to-host copy inside the forward. That copy waits for
every earlier transfer in the device's copy queue: behind the weight publisher's 3.4 GB device-to-host
copy it stalled each RL step by ~50 ms on an H200 (benchmarks/results/rl_trainer.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PackedSeqs:
    position_ids: torch.Tensor  # (T,) int64, flattened over rows
    doc_ids: torch.Tensor  # (T,) int64, document index of each token
    cu_seqlens: torch.Tensor  # (N + 1,) int32, document start offsets plus T
    max_seqlen: int  # longest document (host int: flash kernels need it)
    num_docs: int
    cache: dict[str, Any] = field(default_factory=dict)  # per-backend masks, shared across layers

    @property
    def num_tokens(self) -> int:
        return self.position_ids.numel()

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> PackedSeqs:
        """position_ids: (B, T). Rows are concatenated; each row also starts a new document."""
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be (B, T), got shape {tuple(position_ids.shape)}")
        rows, seq_len = position_ids.shape
        starts = position_ids == 0
        starts[:, 0] = True  # a row that begins mid-document (e.g. truncated) still starts a new one
        starts = starts.reshape(-1)
        doc_ids = torch.cumsum(starts.to(torch.int64), dim=0) - 1
        start_idx = torch.nonzero(starts, as_tuple=False).reshape(-1)
        total = torch.tensor([rows * seq_len], device=start_idx.device, dtype=start_idx.dtype)
        cu_seqlens = torch.cat([start_idx, total]).to(torch.int32)
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        return cls(
            position_ids=position_ids.reshape(-1),
            doc_ids=doc_ids,
            cu_seqlens=cu_seqlens,
            max_seqlen=int(lengths.max().item()),  # one host sync per forward, not per layer
            num_docs=int(lengths.numel()),
        )

    def to(self, device: torch.device | str) -> PackedSeqs:
        """The same boundaries on ``device`` (tensors copied asynchronously; host ints kept, cache dropped)."""
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return PackedSeqs(
            move(self.position_ids), move(self.doc_ids), move(self.cu_seqlens), self.max_seqlen, self.num_docs
        )
