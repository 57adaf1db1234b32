"""`model.offload = "auto"` and `model.ac = "auto"`: pick the memory levers once, at trainer start-up.

Why: the fastest setting is no activation checkpointing (AC) and no CPU offload; each lever trades speed for
memory (on an H200, Qwen3-1.7B shape: AC costs ~1.7x, optimizer offload moves 16 bytes/param across PCIe every
step). A fixed default is wrong for someone: AC + offload on gave 5% MFU on a GPU with 100 GiB free, none of
them runs a 4B model out of memory on a small one. So "auto" estimates the peak of each plan, in order
(cheapest first), and takes the first that fits in `HEADROOM` of the free device memory:

    no AC, no offload -> full AC -> full AC + optimizer offload -> full AC + full offload + AC offloading

`model.reshard_after_forward = "auto"` is a lever too: each plan but full offload is tried first with the bf16
weights gathered once a step and kept to its last backward (false: no re-gather in backward, none per
micro-batch), then resharded after every forward (true). A colocated trainer (optimizer offload, planned for the
GPU while inference sleeps) keeps them too: they are freed after the step's last backward, before inference
wakes. The RL trainer on real-shaped batches (256 rollouts of up to 2,048 tokens, 8,192 tokens a forward, one
H100, 2026-12-05) ran 37,000 tok/s kept against 34,036 resharded (1.087x) for 46.1 against 43.6 GiB: 2 bytes a
parameter bought back ~8% of the step.

The estimate (bytes on one rank), with N parameters (T trainable), FSDP shard count S, t tokens per forward:
- state: fp32 master + fp32 gradient + optimizer state (AdamW 8 bytes, SignSGD 0) per trainable parameter,
  2 bytes per frozen one (LoRA base), all / S. "optimizer" offload keeps the optimizer state off the device
  except around `optimizer.step()` (when activations are gone); "full" leaves 2 bytes/param (bf16 weights).
- gathered bf16 weights: the root unit (embedding, untied LM head) and two blocks in flight (all blocks
  without `reshard_after_forward`).
- activations: no AC, `NO_AC_BYTES` x t x layers x (hidden + MLP width); full AC, `AC_BYTES` x t x layers x
  hidden (each block's bf16 input; 0 with AC offloading) plus one block recomputed without AC; the fused LM
  head's chunk of bf16 logits (min(t, chunk) x vocab x 2; the whole fp32 logits when it is disabled).

Calibration (one H200, torch 2.11, fp32 masters, bf16 compute, compiled blocks, FSDP over one rank, fused LM
head), Qwen3-1.7B, no AC, offload none: the RL trainer on rollout-shaped batches peaked at 43.75 GiB with 8,192
tokens per forward and 91.98 GiB with 32,768 (2026-12-03; at 65,536 it ran out of the H200's 139.8 GiB where the
first fit, `NO_AC_BYTES` = 5.8 from `sft` at 8,192 tokens alone, had predicted 110 GiB). `NO_AC_BYTES` is
the slope of those two RL points (the model predicts 44.9 and 93.2 GiB); for `sft` at 8,192 tokens (38.8
GiB measured) it is 6 GiB high, which only turns AC on a little earlier. With full AC: Qwen3-4B at 8,192
tokens (torchtitan 0.2.2) 64.7 GiB, predicted 65.6; the RL trainer at 131,072 tokens 48.0 GiB, predicted
52. `AC_BYTES` is the bf16 block input. MoE layers count the active experts' width; Nemotron-H the wider of its MLP and
Mamba mixer: both uncalibrated. The plan is a pure function of these numbers (`plan_memory`, tested on
CPU); `resolve_memory` measures the free memory (the minimum over ranks, so every rank takes the same plan)
and returns the config with "auto" replaced. On CPU every lever only costs time, so "auto" is none / none.
Left out: the allocator's fragmentation (covered by `HEADROOM`), NCCL buffers, and shrinking the token budget
when even the last plan does not fit (the plan then logs a warning naming `data.micro_batch_tokens`).

Host memory: what a plan offloads lives in pinned host memory, which cannot be swapped. `host_bytes` is that
per rank (the optimizer state; with "full" also the fp32 masters and gradient accumulators; the AC-offloaded
block inputs), times the node's ranks; `check_host_memory` refuses at start-up a plan that needs more than the
node's available memory (MemAvailable), counting a colocated inference's two rollback copies, which it pins
only later. Before, a Qwen3-8B shape colocated on one H200 (61 GiB of AdamW state, then pinned with a
power-of-two round-up: ~108 GiB) was ended by the host's OOM killer minutes into its first step. Left out there:
vLLM's level-1 sleep (weights kept on the host) and the rollback copies of more than one replica per node.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from prime_rl.common.config.deployment import GPU_CONTEXT_BYTES
from prime_rl.common.config.trainer import ACConfig, ACOffloadingConfig, TrainerModelConfig

GiB = 2**30
NO_AC_BYTES = 9.2
"""Saved activations without AC, bytes per token, layer and unit of (hidden + MLP width); fitted on Qwen3-1.7B."""
AC_BYTES = 2.0
"""Saved activations with full AC, bytes per token, layer and hidden unit: the bf16 block input."""
HEADROOM = 0.9
"""Fraction of the free device memory a plan may fill (the rest: fragmentation, NCCL, the CUDA caching slack)."""

Offload = Literal["none", "optimizer", "full"]
LEVERS: tuple[tuple[Offload, bool, bool], ...] = (
    ("none", False, False),
    ("none", True, False),
    ("optimizer", True, False),
    ("full", True, True),
)
"""(offload, ac, ac_offloading) from the fastest to the one that needs least device memory."""


@dataclass(frozen=True)
class Footprint:
    """What the estimate needs to know about the model."""

    num_params: int
    """All parameters, a tied embedding counted once."""
    num_trainable: int
    num_layers: int
    hidden: int
    mlp_width: int
    """Per-token width of a block's MLP (MoE: the active experts' intermediate sizes summed)."""
    vocab: int
    tied: bool = True


@dataclass(frozen=True)
class MemoryPlan:
    offload: Offload
    ac: bool
    ac_offloading: bool
    reshard_after_forward: bool
    peak_bytes: float
    """Estimated peak of the chosen plan on one rank."""
    state_bytes: float
    """Weights, gradients and optimizer state on the device with no offload (one rank)."""
    activation_bytes: float
    """Activations of one forward without AC."""
    free_bytes: float | None
    """Free device memory it was planned against; None on CPU."""
    fits: bool


def state_bytes(fp: Footprint, offload: Offload, shard: int, optimizer_bytes: int, during_step: bool = False) -> float:
    """Weights, gradients (and optimizer state where it lives on the device) per rank."""
    frozen = fp.num_params - fp.num_trainable
    if offload == "full":
        return 2.0 * fp.num_params / shard
    on_device_optimizer = offload == "none" or during_step
    per_trainable = 8 + (optimizer_bytes if on_device_optimizer else 0)
    return (2.0 * frozen + per_trainable * fp.num_trainable) / shard


def gathered_bytes(fp: Footprint, reshard_after_forward: bool) -> float:
    """Unsharded bf16 weights FSDP holds during forward/backward."""
    embed = fp.vocab * fp.hidden * (1 if fp.tied else 2)
    if not reshard_after_forward:
        return 2.0 * fp.num_params
    per_block = (fp.num_params - embed) / max(fp.num_layers, 1)
    return 2.0 * (embed + 2 * per_block)


def activation_bytes(fp: Footprint, tokens: int, ac: bool, ac_offloading: bool, lm_head_chunk: int | None) -> float:
    """Saved activations of one forward of ``tokens`` tokens (per rank: pass tokens / cp under CP)."""
    block = NO_AC_BYTES * tokens * (fp.hidden + fp.mlp_width)  # one block, nothing checkpointed
    head = min(tokens, lm_head_chunk) * fp.vocab * 2.0 if lm_head_chunk else tokens * fp.vocab * 8.0
    if not ac:
        return fp.num_layers * block + head
    inputs = 0.0 if ac_offloading else AC_BYTES * tokens * fp.num_layers * fp.hidden
    return inputs + block + head


def peak_bytes(
    fp: Footprint,
    tokens: int,
    offload: Offload,
    ac: bool,
    ac_offloading: bool,
    *,
    shard: int = 1,
    optimizer_bytes: int = 8,
    reshard_after_forward: bool = True,
    lm_head_chunk: int | None = 8192,
    extra_bytes: float = 0.0,
) -> float:
    """Estimated peak device memory of one rank: max(forward/backward, optimizer step)."""
    base = gathered_bytes(fp, reshard_after_forward) + extra_bytes
    acts = activation_bytes(fp, tokens, ac, ac_offloading, lm_head_chunk)
    backward = base + state_bytes(fp, offload, shard, optimizer_bytes) + acts
    step = state_bytes(fp, offload, shard, optimizer_bytes, during_step=True)
    return max(backward, step)


def plan_memory(
    fp: Footprint,
    tokens: int,
    free_bytes: float | None,
    *,
    offload: Offload | Literal["auto"] = "auto",
    ac: bool | Literal["auto"] = "auto",
    ac_offloading: bool | Literal["auto"] = "auto",
    shard: int = 1,
    optimizer_bytes: int = 8,
    reshard_after_forward: bool | Literal["auto"] = True,
    lm_head_chunk: int | None = 8192,
    extra_bytes: float = 0.0,
) -> MemoryPlan:
    """The first plan of `LEVERS` (restricted to the explicit choices) whose estimate fits in ``HEADROOM`` x
    ``free_bytes``, or the last one when none fits (``fits`` False). ``free_bytes`` None (CPU): the fastest.
    ``reshard_after_forward`` "auto": each plan but full offload is tried with the weights kept gathered first."""
    kw = dict(shard=shard, optimizer_bytes=optimizer_bytes, lm_head_chunk=lm_head_chunk, extra_bytes=extra_bytes)
    candidates = []
    for lever_offload, lever_ac, lever_ac_offloading in LEVERS:
        o = lever_offload if offload == "auto" else offload
        a = lever_ac if ac == "auto" else ac
        # AC offloading follows the plan: on once everything else is offloaded too (and only with AC on)
        ao = (lever_ac_offloading and a) if ac_offloading == "auto" else ac_offloading
        if reshard_after_forward != "auto":
            reshards: tuple[bool, ...] = (reshard_after_forward,)
        else:  # full offload keeps the weights on the host between uses: there they are resharded
            reshards = (False, True) if o != "full" else (True,)
        for r in reshards:
            if (o, a, ao, r) not in candidates:
                candidates.append((o, a, ao, r))
    state = state_bytes(fp, "none", shard, optimizer_bytes)
    acts = activation_bytes(fp, tokens, False, False, lm_head_chunk)
    for i, (o, a, ao, r) in enumerate(candidates):
        peak = peak_bytes(fp, tokens, o, a, ao, reshard_after_forward=r, **kw)
        fits = free_bytes is None or peak <= HEADROOM * free_bytes
        if fits or i == len(candidates) - 1:
            return MemoryPlan(o, a, ao, r, peak, state, acts, free_bytes, fits)
    raise AssertionError("unreachable: LEVERS is not empty")


def host_bytes(fp: Footprint, offload: Offload, ac_offloading: bool, tokens: int, *, shard: int = 1,
               optimizer_bytes: int = 8) -> float:  # fmt: skip
    """Pinned host memory one rank's plan holds: the optimizer state ("optimizer"), plus the fp32 masters and
    gradient accumulators ("full"), plus the offloaded bf16 block inputs (AC offloading)."""
    per_trainable = {"none": 0, "optimizer": optimizer_bytes, "full": 8 + optimizer_bytes}[offload]
    activations = AC_BYTES * tokens * fp.num_layers * fp.hidden if ac_offloading else 0.0
    return per_trainable * fp.num_trainable / shard + activations


def check_host_memory(
    fp: Footprint, offload: Offload, ac_offloading: bool, tokens: int, available: float | None, *,
    shard: int = 1, optimizer_bytes: int = 8, local_ranks: int = 1, reserved: float = 0.0,
) -> None:  # fmt: skip
    """Raise if the node's ``local_ranks`` ranks, plus ``reserved`` bytes other processes of the run pin later on
    this node (a colocated inference's rollback copies), need more pinned host memory than ``available`` (None:
    unknown, no check): the run would otherwise be killed by the OOM killer once the state is first offloaded."""
    need = local_ranks * host_bytes(fp, offload, ac_offloading, tokens, shard=shard, optimizer_bytes=optimizer_bytes)
    if available is None or need + reserved <= HEADROOM * available:
        return
    what = f"model.offload={offload!r}" + (" with AC offloading" if ac_offloading else "")
    others = (
        f", plus {reserved / GiB:.1f} GiB for the colocated inference's rollback copies (two of the weights; "
        "weight_broadcast.keep_rollback_copy = false drops them)"
        if reserved
        else ""
    )
    raise ValueError(
        f"{what} needs {need / GiB:.1f} GiB of pinned host memory on this node ({local_ranks} rank(s) x "
        f"{fp.num_trainable / 1e9:.2f}B trainable params / {shard} FSDP shard(s)){others}, above {HEADROOM:.0%} of "
        f"the {available / GiB:.1f} GiB the host has available (MemAvailable): add GPUs (FSDP shards the state "
        "over them), train fewer parameters (LoRA), use optim.type = 'sign_sgd' (no state), or free host memory"
    )


def available_host_bytes() -> float | None:
    """MemAvailable of /proc/meminfo (Linux); None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def footprint(cfg: TrainerModelConfig) -> Footprint:
    """Parameter counts from a meta-device copy (LoRA adapters applied), widths from the model's config."""
    from prime_rl.trainer.lora import apply_lora
    from prime_rl.trainer.models import build_model

    model = build_model(cfg.name, attn=cfg.attn, device="meta")
    if cfg.lora is not None:
        apply_lora(model, cfg.lora)
    params = {id(p): p for p in model.parameters()}.values()  # a tied LM head once
    c = model.config
    if c.num_experts:
        width = (c.num_experts_per_tok + c.n_shared_experts) * c.moe_intermediate_size
    elif c.model_type == "nemotron_h":
        width = max(c.intermediate_size, 2 * c.mamba_num_heads * c.mamba_head_dim)
    else:
        width = c.intermediate_size
    return Footprint(
        num_params=sum(p.numel() for p in params),
        num_trainable=sum(p.numel() for p in params if p.requires_grad),
        num_layers=c.num_hidden_layers,
        hidden=c.hidden_size,
        mlp_width=width,
        vocab=c.vocab_size,
        tied=bool(c.tie_word_embeddings),
    )


def plannable_bytes(free: float, total: float, reserved: float, shares_gpu: bool) -> float:
    """The device memory a plan may count on: ``free`` now, or with ``shares_gpu`` (colocated runs) what this
    rank will have while inference sleeps. The trainer starts beside an awake vLLM (at 0.9 of an H200 that left
    10.3 GiB, and the plan then turned full AC and AC offloading on: 3.9k tok/s); a sleeping vLLM keeps its
    context and CUDA graphs, this process its own context (`GPU_CONTEXT_BYTES` each) and what it reserved."""
    return total - 2 * GPU_CONTEXT_BYTES - reserved if shares_gpu else free


def free_device_bytes(device: torch.device, shares_gpu: bool = False) -> float | None:
    """`plannable_bytes` on ``device``, the minimum over all ranks (so every rank takes the same plan); None on
    CPU."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    free = plannable_bytes(free, total, torch.cuda.memory_reserved(device), shares_gpu)
    free = torch.tensor([float(free)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(free, op=dist.ReduceOp.MIN)
    return float(free.item())


def is_resolved(cfg: TrainerModelConfig) -> bool:
    return "auto" not in (cfg.offload, cfg.ac, cfg.ac_offloading, cfg.reshard_after_forward)


def require_resolved(cfg: TrainerModelConfig, where: str) -> None:
    if not is_resolved(cfg):
        raise ValueError(
            f"{where} got model.offload={cfg.offload!r}, ac={cfg.ac!r}, ac_offloading={cfg.ac_offloading!r}, "
            f"reshard_after_forward={cfg.reshard_after_forward!r}: "
            '"auto" must be resolved first; call prime_rl.trainer.memory_plan.resolve_memory (sft and the RL '
            "trainer do) or set them explicitly"
        )


def describe(fp: Footprint, plan: MemoryPlan, tokens: int) -> str:
    """The one log line: the numbers that decided, then the decision."""
    free = "CPU" if plan.free_bytes is None else f"{plan.free_bytes / GiB:.1f} GiB free"
    ac = "full" if plan.ac else "none"
    line = (
        f"memory plan: {fp.num_params / 1e9:.2f}B params ({fp.num_trainable / 1e9:.2f}B trainable), "
        f"{plan.state_bytes / GiB:.1f} GiB state, {plan.activation_bytes / GiB:.1f} GiB activations at {tokens} "
        f"tokens/forward without AC, {free} -> offload {plan.offload}, ac {ac}, "
        f"ac_offloading {'on' if plan.ac_offloading else 'none'}, reshard_after_forward "
        f"{str(plan.reshard_after_forward).lower()} (estimated peak {plan.peak_bytes / GiB:.1f} GiB)"
    )
    if not plan.fits:
        line += (
            f"; even this exceeds {HEADROOM:.0%} of the free memory: lower data.micro_batch_tokens "
            "(or data.micro_batch_size) or add GPUs"
        )
    return line


def resolve_memory(
    cfg: TrainerModelConfig,
    tokens_per_forward: int,
    device: torch.device,
    *,
    shard: int = 1,
    cp: int = 1,
    optimizer_bytes: int = 8,
    extra_bytes_per_param: float = 0.0,
    shares_gpu: bool = False,
    host_reserved_bytes_per_param: float = 0.0,
    logger: logging.Logger | None = None,
) -> TrainerModelConfig:
    """``cfg`` with "auto" offload / ac / ac_offloading / reshard_after_forward replaced by the plan (unchanged if
    none is "auto").
    Every rank must call it (the free memory is reduced over ranks); ``extra_bytes_per_param``: other copies of
    the weights per parameter before sharding (4 for the KL reference model's fp32 copy); ``shares_gpu``: plan
    for the GPU as it is while colocated inference sleeps (`free_device_bytes`); ``host_reserved_bytes_per_param``:
    pinned host bytes per parameter other processes of the run hold on this node later (`check_host_memory`)."""
    tokens = -(-tokens_per_forward // cp)  # each CP rank holds its slice's activations
    if is_resolved(cfg):
        pins = cfg.offload != "none" or cfg.ac_offloading is not None or host_reserved_bytes_per_param > 0
        if device.type == "cuda" and pins:
            _check_host(footprint(cfg), cfg.offload, cfg.ac_offloading is not None, tokens, shard, optimizer_bytes,
                        host_reserved_bytes_per_param)  # fmt: skip
        return cfg
    fp = footprint(cfg)
    extra_bytes = extra_bytes_per_param * fp.num_params / shard
    chunk = None if cfg.fused_lm_head_token_chunk_size == "disabled" else cfg.fused_lm_head_token_chunk_size
    plan = plan_memory(
        fp, tokens, free_device_bytes(device, shares_gpu),
        offload=cfg.offload,
        ac="auto" if cfg.ac == "auto" else cfg.ac is not None,
        ac_offloading="auto" if cfg.ac_offloading == "auto" else cfg.ac_offloading is not None,
        shard=shard, optimizer_bytes=optimizer_bytes, reshard_after_forward=cfg.reshard_after_forward,
        lm_head_chunk=chunk, extra_bytes=extra_bytes,
    )  # fmt: skip
    if logger is not None:
        (logger.info if plan.fits else logger.warning)(describe(fp, plan, tokens))
    if device.type == "cuda":
        _check_host(fp, plan.offload, plan.ac_offloading, tokens, shard, optimizer_bytes, host_reserved_bytes_per_param)
    update: dict = {"offload": plan.offload, "reshard_after_forward": plan.reshard_after_forward}
    if cfg.ac == "auto":
        update["ac"] = ACConfig() if plan.ac else None
    if cfg.ac_offloading == "auto":
        update["ac_offloading"] = ACOffloadingConfig() if plan.ac_offloading else None
    return cfg.model_copy(update=update)


def _check_host(
    fp: Footprint, offload: Offload, ac_offloading: bool, tokens: int, shard: int, opt: int, reserved_per_param: float
) -> None:
    """`check_host_memory` for this node: its ranks from torchrun's LOCAL_WORLD_SIZE, its MemAvailable now (on CPU
    every lever is a no-op, so only CUDA runs call it), others' pinned bytes from ``reserved_per_param``."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    check_host_memory(fp, offload, ac_offloading, tokens, available_host_bytes(), shard=shard, optimizer_bytes=opt,
                      local_ranks=local_ranks, reserved=reserved_per_param * fp.num_params)  # fmt: skip
