"""The RL trainer's IPC publisher: rank 0 fills shared buckets that inference on the same host reads in place.

Every rank takes part in the all-gathers (FSDP shards -> full tensors in the publish dtype); rank 0 alone packs
them into the ring of slots (``prime_rl.trainer.weights.ipc_sender``), refilling a slot as soon as every worker
has read it, so the training loop is blocked for gather + pack + the workers' reads. Waiting for every server to
finish its reload and announcing the version run in the background, as for nccl.

Colocated runs (``[deployment] type = "colocated"``, ``make_room`` given): inference sleeps while the trainer
steps, so the publish wakes it. Once the full tensors are gathered every rank frees what its step left
(``StepOffload.make_room``), the ranks meet at a barrier (vLLM's weights wake on every GPU of the run), then rank
0 sends ``WakeUpRequest(tags=["weights"])`` to every server and pushes into the woken weights. The KV cache stays
asleep: the orchestrator wakes it once the version is announced (``prime_rl.orchestrator.colocate``), so every
rank frees the full copies of the push before the announcement can be made.

Its own module (not a branch of ``publish.build_publisher``) so the filesystem publisher's module stays as it
is; ``build_ipc_publisher`` is picked by the training entrypoint for ``type = "ipc"``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch.distributed as dist

from prime_rl.common.config.rl_trainer import IpcBroadcastConfig
from prime_rl.common.rundir import RunDir
from prime_rl.trainer.model import CausalLM
from prime_rl.trainer.models import model_state_dict_to_hf
from prime_rl.trainer.rl.publish_base import PushPublisher
from prime_rl.trainer.weights.ipc_sender import IpcWeightSender
from prime_rl.trainer.weights.staging import gather_full_tensors
from prime_rl.trainer.world import World

logger = logging.getLogger(__name__)


class IpcPublisher(PushPublisher):
    def __init__(
        self,
        cfg: IpcBroadcastConfig,
        run_dir: RunDir,
        model: CausalLM,
        world: World,
        make_room: Callable[[], None] | None = None,
    ):
        super().__init__(cfg, model, world, "ipc weight update")
        self.run_dir = run_dir
        self.make_room = make_room
        """Colocated runs: frees this rank's step memory before inference's weights wake (None: they never sleep)."""
        self.sender = None
        if world.is_main:
            self.sender = IpcWeightSender(
                cfg.inference_addresses,
                host=cfg.host,
                port=cfg.port,
                memory=cfg.memory,
                device=world.device,
                bucket_bytes=cfg.bucket_bytes,
                timeout_s=cfg.timeout,
                keep_rollback_copy=cfg.keep_rollback_copy,
            )

    def publish(self, version: int) -> float:
        clock = Laps()
        self.flush()  # the previous version is served (and announced) before its slots are refilled
        clock.lap("flush")
        tensors = gather_full_tensors(self.state, self.dtype, keep=self.sender is not None)
        sender = self.sender
        if sender is None:
            for _ in tensors:  # join the all-gathers
                pass
            clock.lap("gather")
            self._wake_inference(None, clock)
            self.last_phases = clock.seconds
            return clock.total()
        hf = model_state_dict_to_hf(dict(tensors), self.model.config)
        named = [(name, t.contiguous()) for name, t in hf.items()]
        clock.lap("gather")
        self._wake_inference(sender, clock)
        sender.stage(version, named)
        clock.lap("push")
        del named, hf
        if self.make_room is not None:
            # The announcement wakes the KV cache into the room this rank leaves: free the full copies first (on
            # the H200 the cached 3.4 GiB of the 1.7B shape made vLLM's wake run out of memory)
            self.make_room()
            clock.lap("free")
        blocked = clock.total()
        self.last_phases = clock.seconds
        self.job.start(lambda: self._serve_then_announce(version, blocked, sender.finish))
        return blocked

    def _wake_inference(self, sender: IpcWeightSender | None, clock: Laps) -> None:
        """Colocated runs, on every rank: free the step's memory, meet, then rank 0 wakes every server's weights."""
        if self.make_room is None:
            return
        self.make_room()
        if dist.is_initialized() and self.world.world_size > 1:
            dist.barrier()  # every GPU of the run has room before vLLM's weights wake on it
        clock.lap("make_room")  # with the barrier's wait for the other ranks: the log below times the wake alone
        if sender is not None:
            sender.wake_weights()
            clock.lap("wake_weights")
            logger.info("woke the weights of %d inference server(s) in %.2fs", len(sender.servers.clients),
                        clock.seconds["wake_weights"])  # fmt: skip


class Laps:
    """Seconds per phase of one publish (``time/publish/<phase>`` in the step's metrics): on the H200 the
    colocated push took 1.82 s at one step and 0.80 s at the next, and only the parts say which part moved."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = now - self.last
        self.last = now

    def total(self) -> float:
        return time.perf_counter() - self.start


def build_ipc_publisher(
    cfg: IpcBroadcastConfig,
    run_dir: RunDir,
    model: CausalLM,
    world: World,
    make_room: Callable[[], None] | None = None,
) -> IpcPublisher:
    """The publisher for ``[weight_broadcast] type = "ipc"``; ``make_room`` for colocated runs (see above)."""
    if getattr(model.model, "lora_config", None) is not None:
        raise ValueError(
            "weight_broadcast.type='ipc' sends full weights; LoRA publishes the adapter alone, through "
            "weight_broadcast.type='filesystem'"
        )
    return IpcPublisher(cfg, run_dir, model, world, make_room)
