"""Publish the policy after each step so inference can serve it.

- filesystem (default): every rank joins the full-state-dict gather; rank 0 writes Hugging Face
  safetensors to ``broadcasts/step_<n>/`` and then, last, the ``STABLE`` marker (the orchestrator
  loads a step only once its marker exists, so a half-written step is never served). Older steps
  beyond ``keep_last`` are deleted.
- nccl: rank 0 pushes the gathered tensors straight into the inference workers over a broadcast
  group (NCCL on GPU, gloo on CPU; ``prime_rl.trainer.weights.broadcast``), then writes the marker
  with no weights so the orchestrator learns the new version.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from prime_rl.common.config.rl_trainer import FilesystemBroadcastConfig, NCCLBroadcastConfig, NixlBroadcastConfig
from prime_rl.common.rundir import RunDir
from prime_rl.trainer.model import CausalLM
from prime_rl.trainer.models import model_state_dict_to_hf, save_hf_weights
from prime_rl.trainer.world import World

if TYPE_CHECKING:
    from prime_rl.trainer.rl.publish_nixl import NixlPublisher

MARKER = "STABLE"
"""Written last into broadcasts/step_<n>/ (the orchestrator's BROADCAST_MARKER)."""


def gather_state_dict(model: CausalLM, dtype: torch.dtype, is_main: bool) -> dict[str, torch.Tensor]:
    """Collective: every rank calls it; rank 0 gets the full state dict in model names (CPU), others {}."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return {}
    return {k.removeprefix("model."): v.to(dtype) for k, v in sd.items()}


class FilesystemPublisher:
    def __init__(self, cfg: FilesystemBroadcastConfig, run_dir: RunDir, model: CausalLM, world: World):
        self.cfg, self.run_dir, self.model, self.world = cfg, run_dir, model, world
        self.dtype = getattr(torch, cfg.dtype)

    def publish(self, version: int) -> float:
        t0 = time.perf_counter()
        state = gather_state_dict(self.model, self.dtype, self.world.is_main)
        if self.world.is_main:
            out = self.run_dir.broadcast_dir(version)
            save_hf_weights(state, out, self.model.config)
            (out / MARKER).touch()
            for old in self.run_dir.broadcast_steps()[: -self.cfg.keep_last]:
                shutil.rmtree(self.run_dir.broadcast_dir(old), ignore_errors=True)
        dist.barrier()
        return time.perf_counter() - t0

    def close(self) -> None:
        pass


class BroadcastPublisher:
    def __init__(self, cfg: NCCLBroadcastConfig, run_dir: RunDir, model: CausalLM, world: World):
        self.cfg, self.run_dir, self.model, self.world = cfg, run_dir, model, world
        self.dtype = getattr(torch, cfg.dtype)
        self.broadcaster = None
        if world.is_main:
            from prime_rl.trainer.weights.broadcast import WeightBroadcaster

            if not cfg.inference_addresses:
                raise ValueError(
                    "weight_broadcast.type='nccl' needs weight_broadcast.inference_addresses (the inference "
                    "servers' control endpoints, tcp://host:port)"
                )
            backend = "nccl" if world.device.type == "cuda" else "gloo"
            self.broadcaster = WeightBroadcaster(
                cfg.inference_addresses, host=cfg.host, port=cfg.port, backend=backend, timeout_s=cfg.timeout
            )
            self.broadcaster.connect()

    def publish(self, version: int) -> float:
        t0 = time.perf_counter()
        state = gather_state_dict(self.model, self.dtype, self.world.is_main)
        if self.broadcaster is not None:
            state = model_state_dict_to_hf(state, self.model.config)
            device = self.world.device
            self.broadcaster.push(version, ((k, v.to(device)) for k, v in state.items()))
            marker_dir: Path = self.run_dir.broadcast_dir(version)
            marker_dir.mkdir(parents=True, exist_ok=True)
            (marker_dir / MARKER).touch()
        dist.barrier()
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.broadcaster is not None:
            self.broadcaster.close()


def build_publisher(
    cfg: FilesystemBroadcastConfig | NCCLBroadcastConfig | NixlBroadcastConfig,
    run_dir: RunDir,
    model: CausalLM,
    world: World,
) -> FilesystemPublisher | BroadcastPublisher | NixlPublisher:
    """The publisher for ``[weight_broadcast]``: filesystem, nccl (gloo on CPU) or nixl."""
    if cfg.type == "nixl":
        from prime_rl.trainer.rl.publish_nixl import NixlPublisher  # needs the nixl extra

        return NixlPublisher(cfg, run_dir, model, world)
    if isinstance(cfg, NCCLBroadcastConfig):
        return BroadcastPublisher(cfg, run_dir, model, world)
    return FilesystemPublisher(cfg, run_dir, model, world)
