"""The RL trainer's NIXL publisher: every trainer rank is a NIXL source the inference workers read from.

Each rank gathers the full state dict (all-gathers, cast to the publish dtype on its device), stages
its slice of every transfer group (``prime_rl.trainer.weights.nixl_source``) and waits for the
receivers' credits. Rank 0 then waits for every server to serve the version and announces it to the
orchestrator in the background (see ``prime_rl.trainer.rl.publish`` for what overlaps and why the
staging itself cannot). The session (layout, peer metadata, prepared reads) is set up on the first
publish, when the tensor specs are known.
"""

from __future__ import annotations

import time
import uuid

import torch.distributed as dist

from prime_rl.common.config.rl_trainer import NixlBroadcastConfig
from prime_rl.common.rundir import RunDir
from prime_rl.trainer.model import CausalLM
from prime_rl.trainer.models import model_state_dict_to_hf
from prime_rl.trainer.rl.publish_base import PushPublisher
from prime_rl.trainer.weights.nixl_source import NixlWeightSender
from prime_rl.trainer.weights.staging import gather_full_tensors
from prime_rl.trainer.world import World


class NixlPublisher(PushPublisher):
    def __init__(self, cfg: NixlBroadcastConfig, run_dir: RunDir, model: CausalLM, world: World):
        super().__init__(cfg, model, world, "nixl weight update")
        self.run_dir = run_dir
        session = [f"prime-rl-{uuid.uuid4().hex[:12]}" if world.is_main else None]
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
            device=world.device,
            **self.sender_options(),
        )

    def publish(self, version: int) -> float:
        start = time.perf_counter()
        self.flush()
        # Every rank stages a slice of every group, so every rank keeps the full tensors (on its device).
        full = dict(gather_full_tensors(self.state, self.dtype, keep=True))
        self.sender.stage(version, model_state_dict_to_hf(full, self.model.config).items())
        del full
        blocked = time.perf_counter() - start
        if self.world.is_main:
            self.job.start(lambda: self._serve_then_announce(version, blocked, self.sender.finish))
        return blocked
