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

Several nodes (a colocated SLURM job, ``World.num_nodes > 1``): a rank's buckets are readable on its own host only,
so each node's local rank 0 (its leader) keeps the full tensors and pushes into its node's servers alone
(``node_servers``: the addresses are listed node by node), on a channel of its own (``node_channel``). Each
leader waits in ``publish`` until its servers serve the version (a background thread must not issue the
collective that follows), every rank learns every node's outcome (one failed node is an error on every rank,
not a hang), and rank 0 announces only once every node's servers serve it. Colocated runs lose nothing by
waiting: no rollout starts before the announcement.

Its own module (not a branch of ``publish.build_publisher``) so the filesystem publisher's module stays as it
is; ``build_ipc_publisher`` is picked by the training entrypoint for ``type = "ipc"``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
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
        self.per_node = world.num_nodes > 1
        """Each node's leader pushes into its node's servers; the version is announced once every node serves it."""
        self.sender = None
        if world.is_node_leader if self.per_node else world.is_main:
            host, port = node_channel(cfg.host, cfg.port, world.num_nodes, world.node_rank)
            self.sender = IpcWeightSender(
                node_servers(cfg.inference_addresses, world.num_nodes, world.node_rank),
                host=host,
                port=port,
                memory=cfg.memory,
                device=world.device,
                bucket_bytes=cfg.bucket_bytes,
                **self.sender_options(),
            )

    def publish(self, version: int) -> float:
        clock = Laps()
        self.flush()  # the previous version is served (and announced) before its slots are refilled
        clock.lap("flush")
        named = self._gather()
        clock.lap("gather")
        if self.per_node:
            return self._publish_per_node(version, named, clock)
        sender = self.sender
        if sender is None:
            self._wake_inference(None, clock)
            self.last_phases = clock.seconds
            return clock.total()
        self._wake_inference(sender, clock)
        sender.stage(version, named)
        clock.lap("push")
        del named
        if self.make_room is not None:
            # The announcement wakes the KV cache into the room this rank leaves: free the full copies first (on
            # the H200 the cached 3.4 GiB of the 1.7B shape made vLLM's wake run out of memory)
            self.make_room()
            clock.lap("free")
        blocked = clock.total()
        self.last_phases = clock.seconds
        self.job.start(lambda: self._serve_then_announce(version, blocked, sender.finish))
        return blocked

    def _gather(self) -> list[tuple[str, torch.Tensor]]:
        """Every rank joins the all-gathers; the sender's rank gets the full tensors in HF names (others: none)."""
        tensors = gather_full_tensors(self.state, self.dtype, keep=self.sender is not None)
        if self.sender is None:
            for _ in tensors:  # join the all-gathers
                pass
            return []
        hf = model_state_dict_to_hf(dict(tensors), self.model.config)
        return [(name, t.contiguous()) for name, t in hf.items()]

    def _publish_per_node(self, version: int, named: list[tuple[str, torch.Tensor]], clock: Laps) -> float:
        """Several nodes, on every rank: each leader wakes, fills and waits for its node's servers; every rank
        learns every node's outcome; rank 0 announces once all serve ``version``. ``named`` is emptied."""
        if self.make_room is not None:
            self._meet(clock)
        error = None if self.sender is None else self._push_to_node(self.sender, version, named, clock)
        failed = node_failures(self._gather_errors(error), self.world.ranks_per_node)
        clock.lap("serve")  # this node's servers, then every other node's
        if failed:
            reasons = "; ".join(f"node {node}: {reason}" for node, reason in failed.items())
            raise RuntimeError(
                f"ipc weight update to version {version} failed on {len(failed)} of {self.world.num_nodes} nodes "
                f"({reasons}); it is not announced and the trainer stops (the failing nodes' servers log why)"
            ) from error
        blocked = clock.total()
        self.last_phases = clock.seconds
        self.last_write_time = clock.seconds["serve"]
        if self.announcer is not None:  # rank 0, in the background as on one node: nothing is left to wait for
            self.job.start(lambda: self._announce(version, None, blocked))
        return blocked

    def _push_to_node(
        self, sender: IpcWeightSender, version: int, named: list[tuple[str, torch.Tensor]], clock: Laps
    ) -> Exception | None:
        """A node leader: wake (colocated), fill and wait until this node's servers serve ``version``; what
        failed, else None (returned, not raised: the other ranks wait for this one's outcome)."""
        try:
            if self.make_room is not None:
                self._wake(sender, clock)
            sender.stage(version, named)
            clock.lap("push")
            named.clear()
            if self.make_room is not None:  # the full copies, before the announcement wakes the KV cache
                self.make_room()
                clock.lap("free")
            sender.finish(version)
        except Exception as e:  # every rank raises it after the exchange below
            logger.error("ipc weight update to version %d failed on node %d: %s: %s", version, self.world.node_rank,
                         type(e).__name__, e)  # fmt: skip
            return e
        return None

    def _gather_errors(self, error: Exception | None) -> list[str | None]:
        """Every rank's failure (None: none), in rank order: a collective every rank joins."""
        errors: list[str | None] = [None] * self.world.world_size
        dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}")
        return errors

    def _wake_inference(self, sender: IpcWeightSender | None, clock: Laps) -> None:
        """Colocated runs, on every rank: free the step's memory, meet, then rank 0 wakes every server's weights."""
        if self.make_room is None:
            return
        self._meet(clock)
        if sender is not None:
            self._wake(sender, clock)

    def _meet(self, clock: Laps) -> None:
        """Colocated runs, on every rank: free the step's memory, then wait for every other rank to have."""
        assert self.make_room is not None
        self.make_room()
        if dist.is_initialized() and self.world.world_size > 1:
            dist.barrier()  # every GPU of the run has room before vLLM's weights wake on it
        clock.lap("make_room")  # with the barrier's wait for the other ranks: the log below times the wake alone

    def _wake(self, sender: IpcWeightSender, clock: Laps) -> None:
        sender.wake_weights()
        clock.lap("wake_weights")
        logger.info("woke the weights of %d inference server(s) in %.2fs", len(sender.servers.clients),
                    clock.seconds["wake_weights"])  # fmt: skip


def node_servers(addresses: Sequence[str], num_nodes: int, node: int) -> list[str]:
    """Node ``node``'s servers: the job lists every node's control addresses node by node (rl.sbatch.j2's
    CONTROL_ADDRS), the same number for each node. One node: every address."""
    if not addresses or len(addresses) % num_nodes:
        raise ValueError(
            f"weight_broadcast.inference_addresses lists {len(addresses)} server(s) for {num_nodes} nodes: ipc pushes "
            "from each node into its own servers, so list every node's servers node by node, the same number per node"
        )
    per_node = len(addresses) // num_nodes
    return list(addresses[node * per_node : (node + 1) * per_node])


def node_channel(host: str, port: int, num_nodes: int, node: int) -> tuple[str, int]:
    """Where node ``node``'s leader hosts its bucket channel. One node: ``host:port`` as configured. Several: on
    loopback (only the servers of the leader's own node read it) at ``port + node``, so that two nodes that are
    one machine (tests/slurm's local cluster) do not bind the same port."""
    if num_nodes == 1:
        return host, port
    return "127.0.0.1", port + node


def node_failures(errors: Sequence[str | None], ranks_per_node: int) -> dict[int, str]:
    """Each failed node's reason, by node, from every rank's error in rank order (only leaders push)."""
    return {rank // ranks_per_node: error for rank, error in enumerate(errors) if error is not None}


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
