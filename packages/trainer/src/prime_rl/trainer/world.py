"""Process-group setup from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT).

Without torchrun (a plain `python -m ...train`), it makes a one-process group on a free local port,
so single-process runs take the exact same code path as distributed ones (FSDP over one rank).
"""

import logging
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from prime_rl.common.net import free_port


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    local_world_size: int = 0
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE); 0: every rank is on one node."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def ranks_per_node(self) -> int:
        return self.local_world_size or self.world_size

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node_rank(self) -> int:
        """This rank's node: torchrun numbers the ranks node by node (rank = node x ranks per node + local rank)."""
        return self.rank // self.ranks_per_node

    @property
    def is_node_leader(self) -> bool:
        return self.local_rank == 0


def init_world() -> World:
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
    return World(
        rank=rank, local_rank=local_rank, world_size=world_size, device=device, local_world_size=local_world_size
    )


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_rank(code: int = 0) -> NoReturn:
    """End a rank process that has finished its work, without interpreter finalization.

    Why: torch keeps every DeviceMesh, and through it every gloo process group with its worker threads,
    alive in DTensor's sharding caches even after `destroy_process_group` (measured on torch 2.13: the
    `pt_gloo_runloop` threads survive destroy, `gc.collect()` and the caches' `cache_clear`). They are torn
    down during interpreter finalization, and a gloo thread that drops its last work there must take the
    GIL; a finalizing interpreter ends such a thread, which unwinds through a noexcept frame:
    "terminate called without an active exception", SIGABRT, exit -6 from a run that succeeded (intermittent,
    under CPU load). `os._exit` skips that teardown; the logs and standard streams are flushed first, and
    everything else a rank owns (monitors, publishers, checkpoints) was closed by the training loop.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
