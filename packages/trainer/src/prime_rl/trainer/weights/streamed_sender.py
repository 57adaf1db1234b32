"""The sequence both streamed weight transports run (nccl: ``broadcast_sender``, ipc: ``ipc_sender``): plan the
bucket layout, have every server validate it (``begin``), stream the buckets (``send``), then wait until every
server serves the version (``finish``).

``stage`` is the part the training loop waits for (plan, begin, send); ``push`` adds ``finish``. The RL
publishers run ``stage`` and leave ``finish`` to a background thread. What differs between the transports, the
group or the shared slots the buckets go through, is each subclass's ``begin`` / ``send`` / ``finish``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import torch

from prime_rl.common.weight_sync.broadcast import BucketLayout, Spec, plan_buckets


class StreamedSender(ABC):
    """Trainer rank 0 of a transport that streams a ``BucketLayout`` to every inference server."""

    bucket_bytes: int
    gave_up: tuple[type[BaseException], ...] = ()
    """Errors of ``send`` that mean a server gave up: its answer to ``finish`` says why (and what serves now),
    so ``stage`` waits for the answers and raises theirs."""

    def plan(self, named_specs: Iterable[Spec]) -> BucketLayout:
        """The bucket layout of an update with these tensor specs (in send order)."""
        return plan_buckets(list(named_specs), self.bucket_bytes)

    @abstractmethod
    def begin(self, version: int, layout: BucketLayout) -> None:
        """Phase 1: every server validates the layout and its workers wait for the buckets."""

    @abstractmethod
    def send(self, version: int, layout: BucketLayout, tensors: Sequence[torch.Tensor]) -> None:
        """Phase 2: stream the buckets (``tensors`` indexed like ``layout.specs``)."""

    @abstractmethod
    def finish(self, version: int) -> None:
        """Phase 3: wait until every server serves ``version``; raises if any failed."""

    def stage(self, version: int, named: Sequence[tuple[str, torch.Tensor]]) -> BucketLayout:
        """Phases 1 and 2 for contiguous ``named`` tensors (in send order); ``finish(version)`` completes them."""
        layout = self.plan(Spec.of(name, t) for name, t in named)
        self.begin(version, layout)
        try:
            self.send(version, layout, [t for _, t in named])
        except self.gave_up:
            self.finish(version)
            raise
        return layout

    def push(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> BucketLayout:
        """One full update; returns when every server serves ``version``. Raises if any refuses or fails."""
        layout = self.stage(version, [(name, t.detach().contiguous()) for name, t in named_tensors])
        self.finish(version)
        return layout
