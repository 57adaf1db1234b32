"""`sft @ sft.toml [--key value ...]`: validate the config, then launch the ranks with torchrun.

Bad configs exit 2 here, before any process starts. `--dry-run` writes the resolved config to
<run_dir>/configs/trainer.toml and exits. Otherwise it starts a new log attempt, writes the resolved
config there, and runs `python -m prime_rl.trainer.torchrun_loopback --nproc-per-node N -m
prime_rl.trainer.sft.train @ <run_dir>/configs/trainer.toml` with N = deployment.num_gpus (or
$WORLD_SIZE, or 1): one process per GPU, or N gloo processes on a machine without GPUs. When `sft`
itself already runs inside a torchrun/SLURM rank (RANK and LOCAL_RANK set), it trains in-process.
"""

import os
import subprocess
import sys
from pathlib import Path

from prime_rl.common import commands
from prime_rl.common.config import parse_config, write_toml
from prime_rl.common.config.slurm_route import run_through_slurm, wants_slurm
from prime_rl.common.config.trainer import SFTConfig
from prime_rl.common.dispatch_kernels import exit_if_moe_kernels_missing
from prime_rl.common.env import TRAINER_LOG_DIR_ENV
from prime_rl.common.rundir import RunDir

PROG = "sft"


def _fail(msg: str) -> None:
    sys.stderr.write(f"{PROG}: error: {msg}\n")
    raise SystemExit(2)


def num_processes(cfg: SFTConfig) -> int:
    if cfg.deployment.num_gpus is not None:
        return cfg.deployment.num_gpus
    return int(os.environ.get("WORLD_SIZE", "1"))


def torchrun_command(config_path: Path, nproc: int) -> list[str]:
    return commands.torchrun_loopback_command(sys.executable, nproc, commands.SFT_TRAINER, config_path)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if wants_slurm(argv):  # multi-node: the launcher writes and submits sft.sbatch
        raise SystemExit(run_through_slurm("sft", argv, PROG))
    cfg = parse_config(SFTConfig, argv, prog=PROG)
    moe = cfg.model.moe  # one line here, not one traceback per rank
    exit_if_moe_kernels_missing(moe.dispatch.type, moe.compute.type, PROG)
    run_dir = RunDir(cfg.output_dir, cfg.run_name)
    if cfg.dry_run:
        path = write_toml(cfg.model_copy(update={"dry_run": False}), run_dir.config_path("trainer"))
        print(f"wrote {path}")
        return
    if not (Path(cfg.model.name) / "config.json").is_file():
        _fail(
            f"model.name={cfg.model.name!r} is not a Hugging Face model directory (no config.json); "
            "pass a local directory with config.json, *.safetensors and tokenizer files"
        )
    if cfg.model.lora is not None:  # target patterns and rank against the model's layers (a meta copy)
        from prime_rl.trainer.lora import check_lora
        from prime_rl.trainer.models import load_arch_config

        try:
            check_lora(cfg.model.lora, load_arch_config(cfg.model.name))
        except ValueError as e:
            _fail(str(e))
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:  # already a rank of some launcher
        from prime_rl.trainer.sft.train import train
        from prime_rl.trainer.world import exit_rank

        train(cfg)
        exit_rank(0)  # a finished rank skips interpreter finalization (see exit_rank)
    nproc = num_processes(cfg)
    import torch

    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        _fail(
            f"deployment.num_gpus={nproc} > {torch.cuda.device_count()} visible GPUs; lower it or set "
            "CUDA_VISIBLE_DEVICES"
        )
    attempt = run_dir.start_attempt()
    config_path = write_toml(cfg, run_dir.config_path("trainer"))
    env = {**os.environ, TRAINER_LOG_DIR_ENV: str(run_dir.trainer_log_dir(attempt))}
    env.pop("WORLD_SIZE", None)  # torchrun sets it per rank
    proc = subprocess.run(torchrun_command(config_path, nproc), env=env)
    raise SystemExit(proc.returncode)


if __name__ == "__main__":
    main()
