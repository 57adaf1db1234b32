"""The SFT loop, one process per rank (launched by `sft` or by hand with torchrun):

    torchrun --nproc-per-node 8 --local-ranks-filter 0 -m prime_rl.trainer.sft.train @ sft.toml

Per step: 1) this rank's micro-batches (a pure function of the step), 2) forward + backward per
micro-batch with the loss normalized by the step's global count of loss tokens, 3) clip, optimizer
step, 4) log Throughput / MFU / Peak Mem. and write metrics.jsonl, 5) checkpoint every N steps.

Loss: mean over all assistant (loss) tokens of the step, across micro-batches and ranks, so N ranks
compute the same gradient as one process on the same rows. FSDP averages gradients over the dp
ranks, so each rank's loss is scaled by dp / global_loss_tokens.

Cheap checks (model dir, tokenizer vs vocab, data, batch divisibility, parallel layout) all run
before the model is built; on a bad input every rank exits with code 2 and rank 0 prints one line.
"""

import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from prime_rl.common.config import parse_config
from prime_rl.common.config.trainer import SFTConfig, SFTDataConfig
from prime_rl.common.logging import setup_logger
from prime_rl.common.monitor import FileMonitor
from prime_rl.common.rundir import RunDir
from prime_rl.trainer.ckpt import CheckpointManager, export_hf, resolve_resume_step
from prime_rl.trainer.data import DataLoader, MicroBatch, build_data_loader
from prime_rl.trainer.logs import redirect_rank_output
from prime_rl.trainer.model import CausalLM, build_training_model
from prime_rl.trainer.models import load_model_config, model_flops_per_token
from prime_rl.trainer.optim.setup import build_optimization
from prime_rl.trainer.parallel import ParallelDims
from prime_rl.trainer.parallel.context import shard_micro_batch
from prime_rl.trainer.parallel.layout import resolve_parallel_dims
from prime_rl.trainer.perf import StepTimer, perf_metrics
from prime_rl.trainer.world import World, close_world, init_world

LOG_DIR_ENV = "PRIME_RL_TRAINER_LOG_DIR"
"""Set by `sft`: where rank files go. Without it (manual torchrun) rank 0 starts a new log attempt."""


def check_model_dir(name: str) -> Path:
    path = Path(name)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.name={name!r} is not a Hugging Face model directory (no config.json there); "
            "pass a local directory with config.json, *.safetensors and tokenizer files"
        )
    return path


def load_tokenizer(model_dir: Path, vocab_size: int):  # noqa: ANN201 - a transformers tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"the tokenizer in {model_dir} has {len(tokenizer)} tokens > the model's vocab_size={vocab_size}: "
            "tokenizer and model do not match; use the tokenizer that ships with the model"
        )
    return tokenizer


def _setup_output(run_dir: RunDir, world: World) -> None:
    log_dir = os.environ.get(LOG_DIR_ENV)
    if log_dir is None:  # manual torchrun: rank 0 opens a new attempt, the others follow logs/latest
        if world.is_main:
            run_dir.start_attempt()
        dist.barrier()
        log_dir = run_dir.trainer_log_dir()
    redirect_rank_output(Path(log_dir) / f"{world.rank}.log", console=world.is_main)


def setup(cfg: SFTConfig, world: World) -> tuple[ParallelDims, DataLoader, object]:
    """Every check that needs no model weights; raises ValueError/FileNotFoundError on bad input."""
    model_dir = check_model_dir(cfg.model.name)
    model_config = load_model_config(str(model_dir))
    dims = resolve_parallel_dims(cfg.model, world.world_size, model_config)
    tokenizer = load_tokenizer(model_dir, model_config.vocab_size) if isinstance(cfg.data, SFTDataConfig) else None
    rank_in_dp = dims.dp_rank(world.rank)  # the cp ranks of one sequence read the same rows
    loader = build_data_loader(cfg.data, tokenizer, model_config.vocab_size, rank_in_dp, dims.dp)
    return dims, loader, model_config


def train(cfg: SFTConfig) -> None:
    run_dir = RunDir(cfg.output_dir, cfg.run_name)
    world = init_world()
    _setup_output(run_dir, world)
    logger = setup_logger("trainer", rank=world.rank, console_ranks=range(world.world_size), level=cfg.log_level)
    try:
        dims, loader, model_config = setup(cfg, world)
    except (ValueError, FileNotFoundError) as e:
        if world.is_main:
            logger.error(str(e))
        close_world()
        sys.exit(2)
    logger.info(
        f"world {world.world_size} ({dims}), device {world.device}, {loader.num_micro_batches} "
        f"micro-batches/step of {cfg.data.micro_batch_size} x {cfg.data.seq_len} tokens"
    )

    torch.manual_seed(cfg.seed)
    mesh = dims.build_mesh(world.device.type)
    model = build_training_model(cfg.model, dims, mesh, world.device)
    optim = build_optimization(cfg.model, cfg.optim, cfg.scheduler, cfg.max_steps, model, world.device, logger)
    optimizer, scheduler, offload = optim.optimizer, optim.scheduler, optim.offload
    ckpt = CheckpointManager(run_dir, cfg.ckpt.keep_last, world.is_main)

    start = resolve_resume_step(run_dir, cfg.ckpt.resume_step) or 0
    if start:
        optim.load_checkpoint(ckpt, start, model)
        logger.info(f"resumed from {run_dir.trainer_checkpoint_dir(start)}")

    flops_per_token = model_flops_per_token(model_config, cfg.data.seq_len)
    monitor = FileMonitor(run_dir) if world.is_main else None
    timer = StepTimer(world.device)
    micro_batches = loader.micro_batches(start) if start < cfg.max_steps else []
    for step in range(start, cfg.max_steps):
        timer.start()
        # no host sync until the optimizer step is queued: the CPU-side clip / optimizer dispatch overlaps
        # the tail of backward instead of running while the GPU idles
        stats = forward_backward(model, micro_batches, dims, world)
        grad_norm = optim.grad_norm(cfg.optim.max_norm)
        lr = scheduler.get_last_lr()[0]
        offload.load()
        optimizer.step()
        if step + 1 < cfg.max_steps:  # build the next step's rows on the CPU while the GPU works
            micro_batches = loader.micro_batches(step + 1)
        offload.offload()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        stats = _to_host(stats)
        metrics = {
            "loss/mean": stats["loss"],
            "loss/tokens": stats["loss_tokens"],
            "optim/grad_norm": grad_norm.item(),
            "optim/lr": lr,
            **perf_metrics(stats["tokens"], timer.stop(), world.world_size, flops_per_token, world.device),
        }
        done = step + 1
        if monitor is not None:
            monitor.log(done, metrics)
        logger.info(
            f"Step {done} | Loss {metrics['loss/mean']:.4f} | Grad norm {metrics['optim/grad_norm']:.3f} | "
            f"LR {lr:.2e} | Throughput {metrics['perf/throughput']:,.0f} tokens/s | MFU {metrics['perf/mfu']:.1%} | "
            f"Peak Mem. {metrics['perf/peak_memory']:.2f} GiB | Step time {metrics['time/step']:.2f}s"
        )
        if cfg.ckpt.interval and (done % cfg.ckpt.interval == 0 or done == cfg.max_steps):
            path = optim.save_checkpoint(ckpt, done, model)
            logger.info(f"saved checkpoint {path}")

    if cfg.ckpt.export_hf:
        out = run_dir.root / "weights" / f"step_{cfg.max_steps}"
        export_hf(model, model.model, out, world.is_main)
        logger.info(f"exported Hugging Face weights to {out}")
    if monitor is not None:
        monitor.close()
    close_world()


def train_step(model: CausalLM, loader: DataLoader, step: int, dims: ParallelDims, world: World) -> dict:
    """Forward + backward over this rank's micro-batches; returns the step's global loss statistics."""
    return _to_host(forward_backward(model, loader.micro_batches(step), dims, world))


def forward_backward(model: CausalLM, micro_batches: list[MicroBatch], dims: ParallelDims, world: World) -> dict:
    """`train_step` without a host sync: "loss" and "loss_tokens" stay device tensors (see `_to_host`)."""
    if dims.cp_enabled:  # each CP rank takes its contiguous slice of every micro-batch
        micro_batches = [shard_micro_batch(mb, dims.cp_rank(world.rank), dims.cp) for mb in micro_batches]
    counts = torch.tensor([sum(mb.num_loss_tokens for mb in micro_batches)], dtype=torch.float64, device=world.device)
    dist.all_reduce(counts)
    loss_tokens = counts[0].clamp(min=1.0)
    # FSDP averages gradients over all ranks (CP ranks included; EP divides expert grads the same way):
    # world / global tokens makes the result the global token mean
    scale = (world.world_size / loss_tokens).float()
    nll_sum = torch.zeros((), dtype=torch.float64, device=world.device)
    tokens = 0
    for mb in micro_batches:
        mb = mb.to(world.device)
        logprobs, _ = model(mb.input_ids, mb.position_ids, mb.targets)  # (T,)
        nll = -logprobs.sum()  # ignored targets have logprob 0
        (nll * scale).backward()
        nll_sum += nll.detach()
        tokens += mb.input_ids.numel()
    dist.all_reduce(nll_sum)
    return {"loss": nll_sum / loss_tokens, "loss_tokens": counts[0], "tokens": tokens * world.world_size}


def _to_host(stats: dict) -> dict:
    return {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in stats.items()}


def main(argv: list[str] | None = None) -> None:
    logging.captureWarnings(True)
    train(parse_config(SFTConfig, argv, prog="sft"))


if __name__ == "__main__":
    main()
