"""Ulysses context parallelism: each of `cp` ranks holds a contiguous 1/cp slice of the packed sequence.

Attention is the only op that mixes tokens, so only it changes: an all-to-all turns the
sequence-sharded Q/K/V `(T/cp, H, D)` into head-sharded `(T, H/cp, D)`, the model's own attention
backend runs on the full sequence for its heads, and a second all-to-all shards the output back.
Everything else (norms, MLPs, MoE, RoPE with each token's own position) is per-token.

Packed documents: the local slice's position_ids are not enough to find document boundaries after the
all-to-all, so a forward pre-hook on the model all-gathers the full position_ids once per forward,
builds the full sequence's `PackedSeqs` (and its attention masks) and hands it to every Ulysses
wrapper. That happens before and outside the blocks: a compiled or checkpointed block only reads it
(building it inside would break `compile.fullgraph` and mutate state from inside the AC region).

GQA: with fewer KV heads than cp the KV heads are replicated (`repeat_interleave`) up to cp heads, so
each rank gets exactly one KV head and the query heads that use it; cp must then be a multiple of
num_key_value_heads. Left out: ring attention (no head limit) and load balancing of causal work.
"""

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from prime_rl.trainer.models.attention import prepare_masks
from prime_rl.trainer.models.packing import PackedSeqs


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_cp(cp: int, world_size: int, dp_replicate: int, num_heads: int, num_kv_heads: int) -> None:
    """Raise with the rule and the valid choices when cp cannot shard this model on this world."""
    if cp == 1:
        return
    if num_heads % cp:
        *head, last = _divisors(num_heads)
        raise ValueError(
            f"cp={cp} must divide num_attention_heads={num_heads}; use {', '.join(map(str, head))} or {last}"
        )
    if num_kv_heads % cp and cp % num_kv_heads:
        *head, last = [d for d in _divisors(num_heads) if num_kv_heads % d == 0 or d % num_kv_heads == 0]
        raise ValueError(
            f"model.cp={cp} must divide num_key_value_heads={num_kv_heads} or be a multiple of it "
            f"(KV heads are replicated when there are fewer than cp); use {', '.join(map(str, head))} or {last}"
        )
    island = world_size // dp_replicate
    if island % cp:
        raise ValueError(
            f"model.cp={cp} must divide the FSDP island world_size // dp_replicate = {island}; "
            f"use one of {', '.join(map(str, _divisors(island)))}"
        )


def shard_sequence(t: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    """(1, T) -> (1, T / cp): this rank's contiguous slice of a packed micro-batch."""
    if t.shape[-1] % cp:
        raise ValueError(
            f"a micro-batch of {t.shape[-1]} tokens does not split over cp={cp} ranks; "
            f"make data.micro_batch_size * data.seq_len a multiple of {cp}"
        )
    size = t.shape[-1] // cp
    return t[..., cp_rank * size : (cp_rank + 1) * size]


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """(T/cp, H, D) sequence-sharded -> (T, H/cp, D) head-sharded."""
    t_local, heads, dim = x.shape
    x = x.reshape(t_local, cp, heads // cp, dim).transpose(0, 1).contiguous()  # (cp, T/cp, H/cp, D)
    x = all_to_all_single_autograd(x.flatten(0, 1), None, None, group)  # chunk j <- rank j's tokens
    return x.reshape(cp * t_local, heads // cp, dim)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """(T, H/cp, D) head-sharded -> (T/cp, H, D) sequence-sharded (inverse of _seq_to_heads)."""
    tokens, heads_local, dim = x.shape
    x = all_to_all_single_autograd(x.contiguous(), None, None, group)  # chunk j <- rank j's heads
    x = x.reshape(cp, tokens // cp, heads_local, dim).transpose(0, 1)  # (T/cp, cp, H/cp, D)
    return x.reshape(tokens // cp, cp * heads_local, dim)


def full_sequence(position_ids: torch.Tensor, group: dist.ProcessGroup, cp: int) -> PackedSeqs:
    """Document boundaries of the whole sequence from this rank's (1, T/cp) slice of position_ids."""
    local = position_ids.reshape(-1).contiguous()
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local, group=group)
    return PackedSeqs.from_position_ids(torch.cat(parts).unsqueeze(0))


class UlyssesAttention(nn.Module):
    """Wraps a core attention backend (same signature) with the Ulysses all-to-alls."""

    def __init__(self, inner: nn.Module, mesh: DeviceMesh):
        super().__init__()
        self.inner = inner
        self.group = mesh.get_group()
        self.cp = mesh.size()
        self.full_seqs: PackedSeqs | None = None  # the whole sequence, set by apply_cp's pre-hook per forward

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs) -> torch.Tensor:
        """q (T/cp, Hq, D), k/v (T/cp, Hkv, D) -> (T/cp, Hq, D); `seqs` (the local slice) is unused."""
        if self.full_seqs is None:
            raise RuntimeError("UlyssesAttention ran without the full sequence: install it with apply_cp(model, mesh)")
        if k.shape[1] < self.cp:  # GQA: one KV head per rank after replication
            rep = self.cp // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        q, k, v = (_seq_to_heads(t, self.group, self.cp) for t in (q, k, v))
        out = self.inner(q, k, v, self.full_seqs)  # (T, Hq/cp, D)
        return _heads_to_seq(out, self.group, self.cp)


def apply_cp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Swap every block's `self_attn.core_attention` for its Ulysses wrapper, and give them the full
    sequence from a pre-hook on `model` (a Transformer: forward(input_ids, position_ids), `.layers`, `.attn`).
    `mesh` is the 1-D mesh of the cp consecutive ranks that share a sequence (`world_mesh["cp"]`)."""
    wrappers = []
    for block in model.layers:
        attn = block.self_attn
        attn.core_attention = UlyssesAttention(attn.core_attention, mesh)
        wrappers.append(attn.core_attention)
    group, cp = mesh.get_group(), mesh.size()

    def set_full_sequence(module: nn.Module, args: tuple, kwargs: dict) -> None:
        position_ids = kwargs["position_ids"] if "position_ids" in kwargs else args[1]
        full = full_sequence(position_ids, group, cp)
        prepare_masks(full, module.attn)
        for wrapper in wrappers:
            wrapper.full_seqs = full

    model.register_forward_pre_hook(set_full_sequence, with_kwargs=True)


def shard_micro_batch(mb: Any, cp_rank: int, cp: int) -> Any:
    """A (1, T) micro-batch (input_ids, position_ids, targets) -> this CP rank's (1, T / cp) slice."""
    fields = {f.name: shard_sequence(getattr(mb, f.name), cp_rank, cp) for f in dataclasses.fields(mb)}
    return dataclasses.replace(mb, **fields)
