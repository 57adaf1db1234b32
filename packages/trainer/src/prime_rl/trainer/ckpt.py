"""Checkpoints: torch DCP (each rank writes its own shards, resharding on load) and Hugging Face export.

Layout: <run_dir>/checkpoints/step_<n>/trainer/ holds model + optimizer + scheduler state; `step`
is the number of optimizer steps done. Data needs no state (the loader is a function of the step).
A checkpoint is complete once rank 0 has written its `.done` marker after everyone finished, so a
crash mid-save never leaves a "latest" checkpoint that cannot be loaded.

Pruning (`keep_last`) removes only the trainer's part of old steps: `step_<n>/orchestrator/` belongs to
the orchestrator, which keeps every step (its state is a few bytes) and resumes from it. A step
directory is removed once nothing is left in it. In an RL run (orchestrator parts exist) pruning never
removes the trainer part of the newest step complete for both: until the orchestrator has saved the
newer steps, that one is the only step a killed run can resume from.

A full disk during a save raises one `DiskFullError` naming the checkpoint and the space left.
"""

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from prime_rl.common.diskfull import naming_disk_full
from prime_rl.common.rundir import RunDir
from prime_rl.trainer.lora import checkpoint_options
from prime_rl.trainer.models import save_hf_weights

DONE = ".done"


def list_checkpoints(run_dir: RunDir) -> list[int]:
    """Steps with a complete trainer checkpoint, oldest first."""
    return [s for s in run_dir.checkpoint_steps() if (run_dir.trainer_checkpoint_dir(s) / DONE).is_file()]


class CheckpointManager:
    def __init__(self, run_dir: RunDir, keep_last: int | None, is_main: bool):
        self.run_dir = run_dir
        self.keep_last = keep_last
        self.is_main = is_main

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
    ) -> Path:
        path = self.run_dir.trainer_checkpoint_dir(step)
        # LoRA: the adapters (and their optimizer state) only; the frozen base is re-read from model.name
        model_sd, optim_sd = get_state_dict(model, optimizer, options=checkpoint_options(model))
        state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "step": step}
        with naming_disk_full(path, f"the trainer checkpoint of step {step}", "free space or lower ckpt.keep_last"):
            dcp.save(state, checkpoint_id=str(path))
        dist.barrier()
        if self.is_main:
            (path / DONE).touch()
            self._prune()
        dist.barrier()
        return path

    def load(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
    ) -> int:
        path = self.run_dir.trainer_checkpoint_dir(step)
        options = checkpoint_options(model)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "step": 0}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
        )
        scheduler.load_state_dict(state["scheduler"])
        return int(state["step"])

    def _prune(self) -> None:
        if self.keep_last is None:
            return
        # Resumable needs every component's part: keep the newest step the orchestrator completed too.
        components = self.run_dir.checkpoint_components()
        protected = self.run_dir.latest_complete_checkpoint(components) if "orchestrator" in components else None
        for step in list_checkpoints(self.run_dir)[: -self.keep_last]:
            if step == protected:
                continue
            shutil.rmtree(self.run_dir.trainer_checkpoint_dir(step), ignore_errors=True)
            try:
                self.run_dir.checkpoint_dir(step).rmdir()  # only if no other component saved there
            except OSError:
                pass


def export_hf(model: torch.nn.Module, inner: torch.nn.Module, out_dir: Path, is_main: bool) -> None:
    """Gather the full state dict on rank 0 (CPU) and write HF safetensors + config + tokenizer there.

    `model` is the FSDP root; `inner` its transformer (whose names the HF converter expects).
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(model, options=options)  # collective: every rank calls it
    if is_main:
        sd = {k.removeprefix("model."): v.to(torch.bfloat16) for k, v in sd.items()}
        save_hf_weights(sd, out_dir, inner.config)
    dist.barrier()
