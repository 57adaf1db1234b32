"""The RL trainer's NIXL publisher: every trainer rank is a NIXL source the inference workers read from.

Each rank gathers the full state dict (FSDP all-gather, kept on its device), stages its slice of every
transfer group (``prime_rl.trainer.weights.nixl``) and waits for the receivers' credits; rank 0 drives
the inference servers and writes the empty ``broadcasts/step_<n>/STABLE`` marker afterwards so the
orchestrator learns the new version, like the nccl publisher. The session (layout, peer metadata,
prepared reads) is set up on the first publish, when the tensor specs are known.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from prime_rl.common.config.rl_trainer import NixlBroadcastConfig
from prime_rl.common.rundir import RunDir
from prime_rl.trainer.model import CausalLM
from prime_rl.trainer.models import model_state_dict_to_hf
from prime_rl.trainer.weights.nixl import NixlWeightSender
from prime_rl.trainer.world import World

MARKER = "STABLE"


class NixlPublisher:
    def __init__(self, cfg: NixlBroadcastConfig, run_dir: RunDir, model: CausalLM, world: World):
        self.cfg, self.run_dir, self.model, self.world = cfg, run_dir, model, world
        self.dtype = getattr(torch, cfg.dtype)
        if world.is_main and not cfg.inference_addresses:
            raise ValueError(
                "weight_broadcast.type='nixl' needs weight_broadcast.inference_addresses (the inference servers' "
                "control endpoints, tcp://host:port)"
            )
        session = [None]
        if world.is_main:
            import uuid

            session[0] = f"prime-rl-{uuid.uuid4().hex[:12]}"
        if world.world_size > 1:
            dist.broadcast_object_list(session, src=0)
        self.sender = NixlWeightSender(
            cfg.inference_addresses if world.is_main else [],
            host=cfg.host,
            port=cfg.port,
            rank=world.rank,
            world_size=world.world_size,
            session=session[0],
            group_bytes=cfg.group_bytes,
            overlap=cfg.overlap_transfer_and_replay,
            keep_rollback_copy=cfg.keep_rollback_copy,
            timeout_s=cfg.timeout,
            device=world.device,
        )

    def publish(self, version: int) -> float:
        t0 = time.perf_counter()
        # Every rank needs the tensors it stages: a full (all-gathered) state dict on its device.
        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
        state = {k.removeprefix("model."): v.to(self.dtype) for k, v in sd.items()}
        state = model_state_dict_to_hf(state, self.model.config)
        self.sender.push(version, state.items())
        if self.world.is_main:
            marker_dir = self.run_dir.broadcast_dir(version)
            marker_dir.mkdir(parents=True, exist_ok=True)
            (marker_dir / MARKER).touch()
        dist.barrier()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sender.close()
