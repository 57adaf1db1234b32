"""Process-group setup from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

Without torchrun (a plain `python -m ...train`), it makes a one-process group on a free local port,
so single-process runs take the exact same code path as distributed ones (FSDP over one rank).
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from prime_rl.common.net import free_port


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_world() -> World:
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
    return World(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
