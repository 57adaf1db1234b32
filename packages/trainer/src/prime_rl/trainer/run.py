"""Set-up both trainer entrypoints share (`sft` and the RL trainer), in the order a rank runs it:

1. `start_rank`: the run dir, torch.distributed, this rank's log file and the "trainer" logger;
2. `bad_input_exits`: the cheap checks run inside it, so a bad input ends every rank with exit code 2 and
   one line from rank 0 instead of a traceback per rank;
3. `inspect_model`: the model dir, its config, the parallel layout and LoRA's targets (no weights read);
4. `build_trainer`: the memory plan, the model, the optimizer and the `Trainer` around them.

What differs between the entrypoints (the batch source, the objective, RL's publisher and reference model)
stays in `sft/train.py` and `rl/train.py`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from prime_rl.common.config.trainer import TrainerModelConfig
from prime_rl.common.env import TRAINER_LOG_DIR_ENV
from prime_rl.common.logging import setup_logger
from prime_rl.common.rundir import RunDir
from prime_rl.trainer.logs import redirect_rank_output
from prime_rl.trainer.loop import Trainer
from prime_rl.trainer.lora import check_lora, log_lora, training_flops_per_token
from prime_rl.trainer.memory_plan import resolve_memory
from prime_rl.trainer.model import CausalLM, build_training_model
from prime_rl.trainer.models import load_arch_config
from prime_rl.trainer.optim.setup import build_optimization
from prime_rl.trainer.parallel import ParallelDims
from prime_rl.trainer.parallel.layout import resolve_parallel_dims
from prime_rl.trainer.world import World, close_world, init_world

Config = TypeVar("Config")  # SFTConfig or RLTrainerConfig: both have model, optim, scheduler, ckpt, monitor


def check_model_dir(name: str) -> Path:
    path = Path(name)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.name={name!r} is not a Hugging Face model directory (no config.json there); "
            "pass a local directory with config.json, *.safetensors and tokenizer files"
        )
    return path


def setup_output(run_dir: RunDir, world: World) -> None:
    """Send this rank's stdout/stderr to its log under the run's current attempt."""
    log_dir = os.environ.get(TRAINER_LOG_DIR_ENV)
    if log_dir is None:  # manual torchrun: rank 0 opens a new attempt, the others follow logs/latest
        if world.is_main:
            run_dir.start_attempt()
        dist.barrier()
        log_dir = run_dir.trainer_log_dir()
    redirect_rank_output(Path(log_dir) / f"{world.rank}.log", console=world.is_main)


def start_rank(output_dir: Path | str, run_name: str, log_level: str) -> tuple[RunDir, World, logging.Logger]:
    run_dir = RunDir(output_dir, run_name)
    world = init_world()
    setup_output(run_dir, world)
    logger = setup_logger("trainer", rank=world.rank, console_ranks=range(world.world_size), level=log_level)
    return run_dir, world, logger


@contextmanager
def bad_input_exits(world: World, logger: logging.Logger) -> Iterator[None]:
    """A ValueError / FileNotFoundError inside (bad config or data) ends the rank with exit code 2."""
    try:
        yield
    except (ValueError, FileNotFoundError) as e:
        if world.is_main:
            logger.error(str(e))
        close_world()
        sys.exit(2)


def inspect_model(model_cfg: TrainerModelConfig, world: World) -> tuple[Path, object, ParallelDims]:
    """The model dir, its config and the parallel layout, checked without reading any weight."""
    model_dir = check_model_dir(model_cfg.name)
    model_config = load_arch_config(str(model_dir))
    dims = resolve_parallel_dims(model_cfg, world.world_size, model_config)
    if model_cfg.lora is not None:  # target patterns and rank against the model's layers, on a meta copy
        check_lora(model_cfg.lora, model_config)
    return model_dir, model_config, dims


def build_trainer(
    cfg: Config,
    dims: ParallelDims,
    world: World,
    run_dir: RunDir,
    logger: logging.Logger,
    tokens_per_forward: int,
    seq_len: int,
    extra_bytes_per_param: float = 0.0,
    shares_gpu: bool = False,
    host_reserved_bytes_per_param: float = 0.0,
) -> tuple[Config, object, CausalLM, Trainer]:
    """Resolve the memory plan ("auto" offload / AC) for ``tokens_per_forward``, then build the sharded model,
    its optimizer and the `Trainer`. Returns the config with the plan filled in, the mesh, the model and the
    trainer. ``shares_gpu``: a colocated RL trainer, which plans for the GPU as inference leaves it asleep;
    ``host_reserved_bytes_per_param``: host memory other processes on the node pin later (`resolve_memory`)."""
    model_cfg = resolve_memory(
        cfg.model, tokens_per_forward, world.device, shard=dims.dp_shard, cp=dims.cp,
        optimizer_bytes=8 if cfg.optim.type == "adamw" else 0, extra_bytes_per_param=extra_bytes_per_param,
        shares_gpu=shares_gpu, host_reserved_bytes_per_param=host_reserved_bytes_per_param,
        logger=logger if world.is_main else None,
    )  # fmt: skip
    cfg = cfg.model_copy(update={"model": model_cfg})
    torch.manual_seed(cfg.seed)
    mesh = dims.build_mesh(world.device.type)
    model = build_training_model(cfg.model, dims, mesh, world.device)
    log_lora(model, logger)
    optim = build_optimization(cfg.model, cfg.optim, cfg.scheduler, cfg.max_steps, model, world.device, logger)
    flops_per_token = training_flops_per_token(model, seq_len)  # LoRA: frozen weights have no dW
    trainer = Trainer(
        model, dims, world, optim, run_dir, logger, flops_per_token, cfg.ckpt.keep_last,
        monitor=cfg.monitor, run_config=cfg.model_dump(mode="json"),
    )  # fmt: skip
    return cfg, mesh, model, trainer
