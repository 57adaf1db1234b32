"""The RL trainer, one process per rank (the `rl` launcher starts it under torchrun):

    torchrun --nproc-per-node 8 -m prime_rl.trainer.rl.train @ train.toml [--data.fake --max-steps 4]

The loop is `prime_rl.trainer.loop.train_loop`, shared with `sft`; what is RL's own is the batch source
(the orchestrator's packed rollouts over ZeroMQ, or fake rows, regrouped into forwards of about
`data.micro_batch_tokens` tokens by `prime_rl.trainer.rl.batching`) and the objective: per forward,
logprobs + entropy through the fused LM head at the rollout temperature and the importance-ratio loss
(normalized by the step's global count of loss tokens). After step s (0-based; its batch was sampled
with policy versions >= s - max_off_policy_steps) the weights are published as policy version s + 1
(`prime_rl.trainer.rl.publish`: filesystem in the background, nccl, nixl) and metrics.jsonl gets loss,
entropy, mismatch_kl, masked fractions, throughput (real tokens, padding excluded; `perf/padding_fraction` is
the share of computed positions that were padding), MFU, peak memory, publish and wall time at step s + 1.

Context parallelism (`model.cp`): the orchestrator sends per data-parallel group; the group's cp rank 0
receives and broadcasts the rows (`prime_rl.trainer.rl.data.ContextParallelSource`), every cp rank builds the
same forwards and trains on its contiguous 1/cp slice of each. Per-sample quantities (sample ids, a sample's
loss tokens for norm = "sequence", the sample count) come from the whole forward before slicing, GSPO's
per-sample log-ratio sums are all-reduced over the cp group (`prime_rl.trainer.rl.loss`), and every metric
sums each token on the one rank that holds it.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from prime_rl.common.config import ConfigError, parse_config
from prime_rl.common.config.layout import LayoutError, check_layout, read_model_shape
from prime_rl.common.config.rl_trainer import RLTrainerConfig, SequenceLossConfig, TokenLossConfig
from prime_rl.common.config.trainer import TrainerModelConfig
from prime_rl.common.dispatch_kernels import exit_if_moe_kernels_missing
from prime_rl.common.rundir import RunDir
from prime_rl.common.wire import DTYPE_ITEMSIZE
from prime_rl.trainer.colocate import StepOffload
from prime_rl.trainer.loop import train_loop
from prime_rl.trainer.lora import BaseModelView
from prime_rl.trainer.model import CausalLM, build_training_model
from prime_rl.trainer.models import PackedSeqs
from prime_rl.trainer.models.router_replay import check_router_replay, replay_mismatch, set_router_replay
from prime_rl.trainer.parallel import ParallelDims, WorldMesh
from prime_rl.trainer.parallel.context import shard_sequence
from prime_rl.trainer.parallel.fsdp import reshard_after_backward
from prime_rl.trainer.rl.batching import TokenBudgetSource
from prime_rl.trainer.rl.data import ContextParallelSource, FakeSource, OrchestratorSource, RLMicroBatch
from prime_rl.trainer.rl.loss import LossSettings, rl_loss, segment_sum
from prime_rl.trainer.rl.publish import build_publisher
from prime_rl.trainer.run import bad_input_exits, build_trainer, inspect_model, start_rank
from prime_rl.trainer.world import World, close_world, exit_rank


class RLObjective:
    """The importance-ratio policy gradient of `prime_rl.trainer.rl.loss`, at each batch's temperature.

    ``norm`` sets the normalization ("token", "sequence", "constant" with ``max_len``); ``ref_model``,
    a frozen copy of the initial policy, supplies the reference logprobs of the KL term (one extra
    forward per micro-batch, no backward). ``cp_group``: the ranks sharing a sequence (the world mesh's
    ``mesh["cp"]``), over which the sequence ratio sums its per-sample log-ratios; required when cp > 1.
    """

    def __init__(
        self,
        dims: ParallelDims,
        world: World,
        settings: LossSettings,
        norm: str = "token",
        max_len: int | None = None,
        ref_model: CausalLM | None = None,
        router_replay: bool = False,
        cp_group: dist.ProcessGroup | None = None,
        logger: logging.Logger | None = None,
    ):
        if dims.cp_enabled and cp_group is None:
            raise ValueError(
                f"RLObjective with cp={dims.cp} needs the cp group, over which GSPO's per-sample log-ratios are "
                'summed; pass cp_group=mesh["cp"].get_group() (mesh = dims.build_mesh(...)), as build_objective does'
            )
        self.dims, self.world, self.settings = dims, world, settings
        self.router_replay = router_replay
        """Route by the experts inference reported (rows' ``routed_experts``); False: only measure the mismatch."""
        self.norm, self.max_len, self.ref_model = norm, max_len, ref_model
        self.cp_group = cp_group
        self.logger = logger
        self._said_unmeasured = False  # the compiled-blocks warning, once a run

    def _token_loss_forward(
        self,
        model: CausalLM,
        mb: RLMicroBatch,
        seqs: PackedSeqs,
        loss_scale: torch.Tensor,
        weights: torch.Tensor | None,
        ref: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, entropy, stats) of the token-ratio loss through the head (``token_loss``): ``rl_loss`` on each
        chunk of tokens, whose statistics (sums) add up to the micro-batch's. Same loss and gradient as ``rl_loss``
        on all the logprobs (every term is per token), one LM-head matmul fewer: no logits recomputed in backward."""
        stats: dict[str, torch.Tensor] = {}

        def token_loss(logprobs: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
            part = slice(t0, t1)
            inference = mb.inference_logprobs[part] if mb.inference_logprobs is not None else logprobs.detach()
            loss, chunk_stats = rl_loss(
                logprobs, inference, mb.advantages[part], mb.loss_mask[part], loss_scale, self.settings,
                weights=None if weights is None else weights[part],
                ref_logprobs=None if ref is None else ref[part],
            )  # fmt: skip
            for key, value in chunk_stats.items():
                stats[key] = stats[key] + value if key in stats else value
            return loss

        loss, _, entropy = model(
            mb.input_ids, mb.position_ids, mb.targets, temperature=mb.temperature, seqs=seqs, token_loss=token_loss
        )
        return loss, entropy, stats

    def forward_backward(
        self, model: CausalLM, batches: list[RLMicroBatch], before_last: Callable[[], None] | None = None
    ) -> dict:
        """No host sync: every statistic stays on the device until the loop reads them all at once."""
        dims, world = self.dims, self.world
        # tokens of samples (padding excluded) and positions computed; every CP rank sees the whole forward
        real = sum(mb.real_tokens for mb in batches) / dims.cp
        computed = sum(mb.input_ids.shape[-1] for mb in batches) / dims.cp
        # per-sample quantities from the whole forward (a CP slice may start or end inside a sample): sample
        # ids of the forward, each position's sample's loss tokens, and samples with a loss token; then each
        # CP rank takes its contiguous slice of every micro-batch and of these
        cp_rank = dims.cp_rank(world.rank)
        prepared = []
        num_samples = 0
        for mb in batches:
            ids = mb.sample_ids()
            per_sample = segment_sum(mb.loss_mask.double(), ids)
            num_samples += int((per_sample > 0).sum())
            sample_tokens = per_sample[ids].float()
            if dims.cp_enabled:
                mb, ids, sample_tokens = (
                    mb.shard(cp_rank, dims.cp), shard_sequence(ids, cp_rank, dims.cp),
                    shard_sequence(sample_tokens, cp_rank, dims.cp),
                )  # fmt: skip
            prepared.append((mb, ids, sample_tokens, per_sample.shape[0]))
        # the step's global counts, from the CPU copies of the masks (no device sync); every CP rank saw the
        # whole forwards, so samples are counted on CP rank 0 alone (loss tokens are counted per slice)
        local = [sum(mb.num_loss_tokens for mb, *_ in prepared), num_samples if cp_rank == 0 else 0, real, computed]
        counts = torch.tensor([float(c) for c in local], dtype=torch.float64, device=world.device)
        dist.all_reduce(counts)
        loss_tokens, samples = counts[0].clamp(min=1.0), counts[1].clamp(min=1.0)
        # FSDP averages gradients over all ranks (CP ranks included): multiplying each rank's divisor by
        # 1 / world makes the result the global normalization
        denominator = {"token": loss_tokens, "sequence": samples}.get(self.norm)
        if denominator is None:  # "constant" (Dr. GRPO)
            denominator = samples * float(self.max_len)
        loss_scale = (denominator / world.world_size).float()
        sums = torch.zeros(10, dtype=torch.float64, device=world.device)  # [6:]: router_replay.replay_mismatch
        for i, (mb, sample_ids, sample_tokens, num_segments) in enumerate(prepared):
            last = i == len(prepared) - 1
            if before_last is not None and last:
                before_last()
            reshard_after_backward(model, last)  # reshard_after_forward = false: gathered once a step
            sample_ids = sample_ids.to(world.device, non_blocking=True)
            seqs = PackedSeqs.from_position_ids(mb.position_ids).to(world.device)  # on the host: no device sync
            mb = mb.to(world.device)
            # before the reference forward too: with LoRA the reference is the same modules without adapters
            set_router_replay(model, mb.routed_experts, self.router_replay)
            ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref, _ = self.ref_model(
                        mb.input_ids, mb.position_ids, mb.targets, temperature=mb.temperature, seqs=seqs
                    )
            weights = None
            if self.norm == "sequence":  # 1 / (the sample's loss tokens): each sample weighs the same
                weights = 1.0 / sample_tokens.to(world.device, non_blocking=True).clamp(min=1.0)
            # (T,) each: logprob / entropy of token t+1 at position t, like every array of the micro-batch
            if self.settings.ratio == "token":  # every token's term reads its own logprob: the head forms the gradient
                loss, entropy, stats = self._token_loss_forward(model, mb, seqs, loss_scale, weights, ref)
            else:  # a sample's ratio reads all its tokens' logprobs: logprobs first, the loss through autograd
                logprobs, entropy = model(
                    mb.input_ids, mb.position_ids, mb.targets, temperature=mb.temperature, seqs=seqs
                )
                inference = mb.inference_logprobs if mb.inference_logprobs is not None else logprobs.detach()
                loss, stats = rl_loss(
                    logprobs, inference, mb.advantages, mb.loss_mask, loss_scale, self.settings,
                    weights=weights, sample_ids=sample_ids, ref_logprobs=ref, num_segments=num_segments,
                    cp_group=self.cp_group,
                )  # fmt: skip
            loss.backward()
            sums[6:] += replay_mismatch(model, world.device, mb.routed_experts)
            masked_entropy = torch.where(mb.loss_mask, entropy.detach(), torch.zeros_like(entropy)).sum()
            sums[:6] += torch.stack(
                [
                    loss.detach().double(),
                    masked_entropy.double(),
                    stats["mismatch_kl"].double(),
                    stats["masked_low"].double(),
                    stats["masked_high"].double(),
                    stats.get("kl_ref", torch.zeros((), device=world.device)).double(),
                ]
            )
        set_router_replay(model, None, False)
        dist.all_reduce(sums)
        mean = sums / loss_tokens
        out = {
            "loss/mean": sums[0] / world.world_size,  # each rank's loss is its share of the global objective
            "entropy/mean": mean[1],
            "mismatch_kl": mean[2],
            "masked/low_fraction": mean[3],
            "masked/high_fraction": mean[4],
            "loss/tokens": counts[0],
            "loss/samples": counts[1],
            "tokens": counts[2],  # real tokens: what perf/throughput counts
            "perf/padding_fraction": 1.0 - counts[2] / counts[3].clamp(min=1.0),
            # tokens whose top-k experts differ from inference's at some MoE layer (before replay), and per layer
            "router/expert_mismatch": sums[6] / sums[7].clamp(min=1.0),
            "router/expert_mismatch_layer": sums[8] / sums[9].clamp(min=1.0),
            "router/reported_tokens": sums[7],
        }
        if self.ref_model is not None:
            out["kl_ref"] = mean[5]
        return out

    def metrics(self, stats: dict[str, float]) -> dict[str, float]:
        # router/*: only when inference reported routed experts (orchestrator.routed_experts), and the mismatch
        # only where the blocks measured it (eager: `replay_mismatch`)
        no_experts = not stats.get("router/reported_tokens")
        unmeasured = not no_experts and math.isnan(stats.get("router/expert_mismatch", 0.0))
        if unmeasured and not self._said_unmeasured and self.logger is not None:
            self._said_unmeasured = True
            self.logger.warning(
                "router/expert_mismatch is not measured: inference reports routed experts, but compiled MoE blocks "
                "skip the comparison (router replay itself still routes by them); set trainer.model.compile = "
                '"None" to measure it'
            )
        return {
            k: v
            for k, v in stats.items()
            if k not in ("tokens", "optim/grad_norm")
            and not (no_experts and k.startswith("router/"))
            and not (unmeasured and k.startswith("router/expert_mismatch"))
        }

    def summary(self, m: dict[str, float]) -> str:
        masked = m["masked/low_fraction"] + m["masked/high_fraction"]
        return (
            f"Loss {m['loss/mean']:.4f} | Entropy {m['entropy/mean']:.3f} | Mismatch KL {m['mismatch_kl']:.2e} | "
            f"Masked {masked:.1%}"
        )


def build_objective(
    loss: TokenLossConfig | SequenceLossConfig,
    model_cfg: TrainerModelConfig,
    dims: ParallelDims,
    mesh: WorldMesh,
    world: World,
    logger: logging.Logger,
    policy: CausalLM | None = None,
) -> RLObjective:
    """The objective ``[loss]`` describes; with ``[loss.kl]`` a frozen copy of the initial weights as reference
    (with LoRA: ``policy`` with its adapters off, the frozen base, instead of a copy)."""
    if loss.type == "sequence":
        settings = LossSettings("sequence", loss.sequence_mask_low, loss.sequence_mask_high)
    else:
        settings = LossSettings("token", loss.token_mask_low, loss.token_mask_high)
    ref_model = None
    if loss.kl is not None:
        settings = replace(settings, kl_coef=loss.kl.coef, kl_estimator=loss.kl.estimator)
        if model_cfg.lora is not None and policy is not None:  # the initial policy is the frozen base itself
            ref_model = BaseModelView(policy)
        else:  # same layout as the policy (FSDP-sharded, so + 4 bytes/param / dp ranks), never stepped
            ref_model = build_training_model(model_cfg, dims, mesh, world.device).requires_grad_(False)
        logger.info(f"KL control: {loss.kl.estimator} x {loss.kl.coef} against a frozen copy of {model_cfg.name}")
    cp_group = mesh["cp"].get_group() if dims.cp_enabled else None  # the cp ranks of one sequence
    return RLObjective(
        dims, world, settings, loss.norm, loss.max_len, ref_model, model_cfg.moe.router_replay, cp_group, logger
    )


def apply_env_vars(env_vars: dict[str, str]) -> None:
    """Set ``trainer.env_vars`` before anything reads them (CUDA, JIT compilers); ``${VAR}`` expands."""
    for key, value in env_vars.items():
        os.environ[key] = os.path.expandvars(value)


def colocated_rollback_bytes_per_param(cfg: RLTrainerConfig) -> float:
    """Host bytes per parameter a colocated inference on this node pins for rollback: two copies of the pushed
    weights (the served version's and the one streaming in, `prime_rl.inference.worker.broadcast.HostBuffers`);
    0 for split runs (inference has its own hosts) or without rollback copies. One replica's worth: more data-
    parallel replicas on the node each keep their own, which this lower bound leaves out."""
    wb = cfg.weight_broadcast
    if not cfg.offload_between_steps or not getattr(wb, "keep_rollback_copy", False):
        return 0.0
    return 2.0 * DTYPE_ITEMSIZE[wb.dtype]


def train(cfg: RLTrainerConfig) -> None:
    apply_env_vars(cfg.env_vars)
    run_dir, world, logger = start_rank(cfg.output_dir, cfg.run_name, cfg.log_level)
    with bad_input_exits(world, logger):
        _model_dir, model_config, dims = inspect_model(cfg.model, world)
        if cfg.model.moe.router_replay:
            check_router_replay(model_config, cfg.model.name)
        dp_rank = dims.dp_rank(world.rank)  # the cp ranks of one sequence train on the same rows
        if cfg.data.fake is not None:
            source = FakeSource(cfg.data.fake, cfg.data.seq_len, model_config.vocab_size, dp_rank, dims.dp)
        elif dims.cp_enabled:  # one socket per dp group: its cp rank 0 receives and broadcasts (see rl.data)
            data = cfg.data
            source = ContextParallelSource(
                lambda: OrchestratorSource(data.host, data.port, dp_rank, data.timeout),
                dims.cp_rank(world.rank), dims.cp, data.timeout,
            )  # fmt: skip
        else:
            source = OrchestratorSource(cfg.data.host, cfg.data.port, dp_rank, cfg.data.timeout)

    source = TokenBudgetSource(source, cfg.data.tokens_per_forward, dims.cp)
    # a row longer than the budget is its own forward: the plan covers the longer of the two
    tokens = max(cfg.data.tokens_per_forward or 0, cfg.data.seq_len)
    reference = cfg.loss.kl is not None and cfg.model.lora is None  # a frozen fp32 copy of the weights
    cfg, mesh, model, trainer = build_trainer(
        cfg, dims, world, run_dir, logger, tokens, cfg.data.seq_len,
        extra_bytes_per_param=4.0 if reference else 0.0, shares_gpu=cfg.offload_between_steps,
        host_reserved_bytes_per_param=colocated_rollback_bytes_per_param(cfg),
    )  # fmt: skip
    step_offload = StepOffload(world.device, trainer.optim.offload) if cfg.offload_between_steps else None
    if cfg.weight_broadcast.type == "ipc":  # shared buffers on one host (its own module: publish_ipc)
        from prime_rl.trainer.rl.publish_ipc import build_ipc_publisher

        # colocated: the publish wakes inference's weights, after freeing the step's memory
        make_room = step_offload.make_room if step_offload is not None else None
        publisher = build_ipc_publisher(cfg.weight_broadcast, run_dir, model, world, make_room)
    else:
        publisher = build_publisher(cfg.weight_broadcast, run_dir, model, world)
    objective = build_objective(cfg.loss, cfg.model, dims, mesh, world, logger, policy=model)
    logger.info(f"RL trainer: world {world.world_size} ({dims}), device {world.device}, {cfg.max_steps} steps")
    try:
        train_loop(
            trainer,
            source,
            objective,
            max_steps=cfg.max_steps,
            max_norm=cfg.optim.max_norm,
            ckpt_interval=cfg.ckpt.interval,
            resume_step=cfg.ckpt.resume_step,
            publisher=publisher,
            step_offload=step_offload,
        )
    finally:
        source.close()
        publisher.close()  # waits for the last version's background write
    logger.info("Finished training")
    close_world()


def check_dry_run(cfg: RLTrainerConfig) -> None:
    """At ``--dry-run``: the parallel layout against the model's config.json (and $WORLD_SIZE when set), as
    `rl --dry-run` checks it for a whole run. A started trainer checks the same on every rank before reading
    any weight (`prime_rl.trainer.run.inspect_model`) and reports it once, from rank 0."""
    if not cfg.dry_run:
        return
    world = os.environ.get("WORLD_SIZE", "")
    try:
        check_layout(
            cfg.model, int(world) if world.isdigit() else None, read_model_shape(cfg.model.name), "", "WORLD_SIZE"
        )
    except LayoutError as e:
        raise ConfigError(str(e), keys=e.keys) from None


def main(argv: list[str] | None = None) -> None:
    logging.captureWarnings(True)
    cfg = parse_config(RLTrainerConfig, argv, prog="trainer", check=check_dry_run)
    exit_if_moe_kernels_missing(cfg.model.moe.dispatch.type, cfg.model.moe.compute.type, "trainer")  # --dry-run too
    if cfg.dry_run:
        from prime_rl.common.config import write_toml

        path = write_toml(cfg, RunDir(cfg.output_dir, cfg.run_name).config_path("trainer"))
        print(f"wrote {path}")
        return
    train(cfg)


if __name__ == "__main__":
    main()
    exit_rank(0)  # not interpreter finalization: see exit_rank
