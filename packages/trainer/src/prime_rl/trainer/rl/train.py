"""The RL trainer, one process per rank (the `rl` launcher starts it under torchrun):

    torchrun --nproc-per-node 8 -m prime_rl.trainer.rl.train @ train.toml [--data.fake --max-steps 4]

Per step s (0-based; the batch for step s was sampled with policy versions >= s - max_off_policy_steps):
1) this rank's micro-batches (orchestrator over ZeroMQ, or fake rows),
2) per micro-batch: logprobs + entropy through the fused LM head at the rollout temperature, the
   importance-ratio loss (normalized by the step's global count of loss tokens), backward,
3) clip, optimizer step,
4) publish the weights as policy version s + 1 (filesystem: broadcasts/step_<s+1>/ + marker; nccl:
   broadcast into the inference workers),
5) log loss, entropy, mismatch_kl, masked fractions, throughput, MFU, peak memory; checkpoint when due.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
import torch.distributed as dist

from prime_rl.common.config import parse_config
from prime_rl.common.config.rl_trainer import RLTrainerConfig
from prime_rl.common.logging import setup_logger
from prime_rl.common.monitor import FileMonitor
from prime_rl.common.rundir import RunDir
from prime_rl.trainer.ckpt import CheckpointManager, resolve_resume_step
from prime_rl.trainer.model import CausalLM, build_training_model
from prime_rl.trainer.models import load_model_config, model_flops_per_token
from prime_rl.trainer.optim.setup import build_optimization
from prime_rl.trainer.parallel import ParallelDims
from prime_rl.trainer.parallel.layout import resolve_parallel_dims
from prime_rl.trainer.perf import StepTimer, perf_metrics
from prime_rl.trainer.rl.data import FakeSource, OrchestratorSource, RLMicroBatch
from prime_rl.trainer.rl.loss import LossSettings, rl_loss
from prime_rl.trainer.rl.publish import build_publisher
from prime_rl.trainer.sft.train import _setup_output, check_model_dir
from prime_rl.trainer.world import World, close_world, init_world


def train_step(
    model: CausalLM, batches: list[RLMicroBatch], dims: ParallelDims, world: World, settings: LossSettings
) -> dict[str, float]:
    if dims.cp_enabled:  # each CP rank takes its contiguous slice of every micro-batch
        batches = [mb.shard(dims.cp_rank(world.rank), dims.cp) for mb in batches]
    local_tokens = sum(mb.num_loss_tokens for mb in batches)
    counts = torch.tensor([float(local_tokens)], dtype=torch.float64, device=world.device)
    dist.all_reduce(counts)
    global_tokens = max(counts.item(), 1.0)
    # FSDP averages gradients over all ranks (CP ranks included): global_tokens / world gives the token mean
    loss_scale = global_tokens / world.world_size
    sums = torch.zeros(6, dtype=torch.float64, device=world.device)
    for mb in batches:
        mb = mb.to(world.device)
        # (T,) each: logprob / entropy of token t+1 at position t, like every array of the micro-batch
        logprobs, entropy = model(mb.input_ids, mb.position_ids, mb.targets, temperature=mb.temperature)
        inference = mb.inference_logprobs if mb.inference_logprobs is not None else logprobs.detach()
        loss, stats = rl_loss(logprobs, inference, mb.advantages, mb.loss_mask, loss_scale, settings)
        loss.backward()
        masked_entropy = torch.where(mb.loss_mask, entropy.detach(), torch.zeros_like(entropy)).sum()
        sums += torch.stack(
            [
                loss.detach().double() * loss_scale,
                masked_entropy.double(),
                stats["mismatch_kl"].double(),
                stats["masked_low"].double(),
                stats["masked_high"].double(),
                torch.tensor(float(mb.input_ids.numel()), dtype=torch.float64, device=world.device),
            ]
        )
    dist.all_reduce(sums)
    loss_sum, entropy_sum, kl_sum, low, high, tokens = sums.tolist()
    tokens /= dims.cp  # every CP rank counted its slice of the same rows
    return {
        "loss/mean": loss_sum / global_tokens,
        "entropy/mean": entropy_sum / global_tokens,
        "mismatch_kl": kl_sum / global_tokens,
        "masked/low_fraction": low / global_tokens,
        "masked/high_fraction": high / global_tokens,
        "loss/tokens": global_tokens,
        "tokens": tokens,
    }


def apply_env_vars(env_vars: dict[str, str]) -> None:
    """Set ``trainer.env_vars`` before anything reads them (CUDA, JIT compilers); ``${VAR}`` expands."""
    for key, value in env_vars.items():
        os.environ[key] = os.path.expandvars(value)


def train(cfg: RLTrainerConfig) -> None:
    apply_env_vars(cfg.env_vars)
    run_dir = RunDir(cfg.output_dir, cfg.run_name)
    world = init_world()
    _setup_output(run_dir, world)
    logger = setup_logger("trainer", rank=world.rank, console_ranks=range(world.world_size), level=cfg.log_level)
    try:
        model_dir = check_model_dir(cfg.model.name)
        model_config = load_model_config(str(model_dir))
        dims = resolve_parallel_dims(cfg.model, world.world_size, model_config)
        dp_rank = dims.dp_rank(world.rank)  # the cp ranks of one sequence train on the same rows
        if cfg.data.fake is not None:
            source = FakeSource(cfg.data.fake, cfg.data.seq_len, model_config.vocab_size, dp_rank, dims.dp)
        elif dims.cp_enabled:
            raise ValueError(
                f"model.cp={dims.cp} with orchestrator data is not supported yet (each orchestrator socket feeds "
                "one rank); use cp=1 for RL, or --data.fake to benchmark context parallelism"
            )
        else:
            source = OrchestratorSource(cfg.data.host, cfg.data.port, dp_rank, cfg.data.timeout)
    except (ValueError, FileNotFoundError) as e:
        if world.is_main:
            logger.error(str(e))
        close_world()
        sys.exit(2)

    torch.manual_seed(cfg.seed)
    mesh = dims.build_mesh(world.device.type)
    model = build_training_model(cfg.model, dims, mesh, world.device)
    optim = build_optimization(cfg.model, cfg.optim, cfg.scheduler, cfg.max_steps, model, world.device, logger)
    optimizer, scheduler, offload = optim.optimizer, optim.scheduler, optim.offload
    ckpt = CheckpointManager(run_dir, cfg.ckpt.keep_last, world.is_main)
    publisher = build_publisher(cfg.weight_broadcast, run_dir, model, world)
    settings = LossSettings(cfg.loss.token_mask_low, cfg.loss.token_mask_high)

    start = resolve_resume_step(run_dir, cfg.ckpt.resume_step) or 0
    if start:
        optim.load_checkpoint(ckpt, start, model)
        logger.info(f"resumed from {run_dir.trainer_checkpoint_dir(start)}")

    flops_per_token = model_flops_per_token(model_config, cfg.data.seq_len)
    monitor = FileMonitor(run_dir) if world.is_main else None
    timer = StepTimer(world.device)
    logger.info(f"RL trainer: world {world.world_size} ({dims}), device {world.device}, steps {start}..{cfg.max_steps}")
    for step in range(start, cfg.max_steps):
        batches, _ = source.get(step)
        timer.start()
        stats = train_step(model, batches, dims, world, settings)
        grad_norm = optim.grad_norm(cfg.optim.max_norm)
        lr = scheduler.get_last_lr()[0]
        offload.load()
        optimizer.step()
        offload.offload()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step_time = timer.stop()
        done = step + 1
        publish_time = publisher.publish(done)
        metrics = {
            **{k: v for k, v in stats.items() if k != "tokens"},
            "optim/grad_norm": grad_norm.item(),
            "optim/lr": lr,
            "time/publish_weights": publish_time,
            **perf_metrics(int(stats["tokens"]), step_time, world.world_size, flops_per_token, world.device),
        }
        if monitor is not None:
            monitor.log(done, metrics)
        logger.info(
            f"Step {done} | Loss {metrics['loss/mean']:.4f} | Entropy {metrics['entropy/mean']:.3f} | "
            f"Mismatch KL {metrics['mismatch_kl']:.2e} | Masked {metrics['masked/low_fraction'] + metrics['masked/high_fraction']:.1%} | "
            f"Throughput {metrics['perf/throughput']:,.0f} tokens/s | MFU {metrics['perf/mfu']:.1%} | "
            f"Peak Mem. {metrics['perf/peak_memory']:.2f} GiB | Step time {step_time:.2f}s"
        )
        if cfg.ckpt.interval and (done % cfg.ckpt.interval == 0 or done == cfg.max_steps):
            path = optim.save_checkpoint(ckpt, done, model)
            logger.info(f"saved checkpoint {path}")

    logger.info("Finished training")
    source.close()
    publisher.close()
    if monitor is not None:
        monitor.close()
    close_world()


def main(argv: list[str] | None = None) -> None:
    logging.captureWarnings(True)
    cfg = parse_config(RLTrainerConfig, argv, prog="trainer")
    if cfg.dry_run:
        from prime_rl.common.config import write_toml

        path = write_toml(cfg, RunDir(cfg.output_dir, cfg.run_name).config_path("trainer"))
        print(f"wrote {path}")
        return
    train(cfg)


if __name__ == "__main__":
    main()
