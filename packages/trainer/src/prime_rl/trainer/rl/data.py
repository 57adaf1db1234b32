"""Where RL micro-batches come from: the orchestrator over ZeroMQ, or fake rows for benchmarks.

A micro-batch row holds packed samples in the orchestrator's convention: per token t, ``loss_mask[t]``
and ``inference_logprobs[t]`` refer to token t itself (its logprob given the tokens before it). The
model's LM head predicts token t+1 from position t, so on arrival every per-token array is shifted to
*positions*: ``targets[t]``, ``loss_mask[t]``, ``advantages[t]`` and ``inference_logprobs[t]`` all
describe token t+1 (nothing at a sample's last position). Aligned this way, a micro-batch can be cut
into contiguous context-parallel slices with no value crossing a slice boundary.

Context parallelism (``model.cp > 1``): the cp consecutive ranks of a data-parallel group train on the
same rows, each on its contiguous 1/cp slice of every forward. The orchestrator sends per data-parallel
group (``orchestrator.num_train_ranks`` = trainer ranks / cp), and ``ContextParallelSource`` lets the
group's cp rank 0 alone receive, then broadcasts the decoded rows to the group's other cp ranks over a
CPU gloo group. Why this and not one socket per cp rank: ZeroMQ PUSH/PULL would split, not duplicate,
the messages between two ranks on one socket, so the latter needs the orchestrator to send each batch cp
times on cp sockets (cp x the serialization and the wire); the broadcast keeps the orchestrator's side
unchanged (one socket per dp group) and costs one host-side broadcast of the decoded rows per step.
Measured (2 gloo ranks on loopback, a shared 2-core CPU host, ``broadcast_object_list`` of 8 rows): 17 ms
per step for 8k-65k tokens of rows (0.3-2.2 MB), 35 ms for 262k tokens (8.7 MB); 262k tokens take ~8 s
to train on one H200 at 33k tokens/s (issue 29), so the broadcast is under 0.5% of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

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
    routed_experts: torch.Tensor | None = None
    """(T, layers, top_k) int16: the experts inference routed token t to (not shifted: the forward routes token t
    at position t), -1 where it reported none; None when the orchestrator sent none."""

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
            None
            if self.routed_experts is None
            else shard_sequence(self.routed_experts.movedim(0, -1), cp_rank, cp).movedim(-1, 0),
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
            move(self.routed_experts),
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
        routed_experts=routed_experts_of(arrays),
    )


def routed_experts_of(arrays: dict[str, np.ndarray]) -> torch.Tensor | None:
    """A received row's routed experts as (T, layers, top_k), or None when it has none."""
    experts = arrays.get("routed_experts")
    return None if experts is None else torch.from_numpy(np.ascontiguousarray(experts).reshape(-1, *experts.shape[-2:]))


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


class ContextParallelSource:
    """The cp ranks of one data-parallel group get the same rows: cp rank 0 pulls them from ``make_source()``
    (an `OrchestratorSource` on its dp group's socket) and broadcasts them over a gloo group of the cp ranks.

    Every rank must construct it (the subgroups are created collectively). An error on cp rank 0 (timeout,
    step mismatch) reaches the other cp ranks as a RuntimeError with its message instead of a hang."""

    def __init__(self, make_source, cp_rank: int, cp: int, timeout_s: float):  # noqa: ANN001 - () -> BatchSource
        from datetime import timedelta

        world = dist.get_world_size()
        groups = [list(range(d * cp, (d + 1) * cp)) for d in range(world // cp)]
        # cp ranks other than 0 wait in the broadcast as long as cp rank 0 waits on the orchestrator
        self.group, _ = dist.new_subgroups_by_enumeration(
            groups, timeout=timedelta(seconds=timeout_s + 60), backend="gloo"
        )
        self.src = dist.get_global_rank(self.group, 0)
        self.source = make_source() if cp_rank == 0 else None

    def get(self, step: int) -> list[RLMicroBatch]:
        payload: list = [None]
        error: BaseException | None = None
        if self.source is not None:
            try:
                payload = [self.source.get(step)]
            except Exception as e:  # noqa: BLE001 - re-raised below, after the other cp ranks hear of it
                error = e
                payload = [RuntimeError(f"context-parallel rank 0 of this group failed to receive step {step}: {e}")]
        dist.broadcast_object_list(payload, src=self.src, group=self.group)
        if error is not None:
            raise error
        if isinstance(payload[0], Exception):
            raise payload[0]
        return payload[0]

    def close(self) -> None:
        if self.source is not None:
            self.source.close()


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
