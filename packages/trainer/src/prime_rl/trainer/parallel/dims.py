"""Parallel layout: world = dp_replicate x dp_shard (HSDP); dp_shard is the FSDP island.

Context parallelism (cp) and expert parallelism (ep) split the island further: cp consecutive ranks
share one sequence (so `dp`, the ranks that see different data, is world // cp), and ep consecutive
ranks share one set of experts (ep is a multiple of cp, so a CP group never straddles two EP groups).
Their meshes are built by parallel/context.py and parallel/expert.py.
"""

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int
    cp: int = 1
    ep: int = 1

    @classmethod
    def from_world(cls, world_size: int, dp_replicate: int) -> "ParallelDims":
        """Resolve dp_shard = world_size / dp_replicate; raises with the valid choices if it doesn't divide."""
        if world_size % dp_replicate:
            choices = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(
                f"model.dp_replicate={dp_replicate} must divide the world size {world_size}; use one of {choices}"
            )
        return cls(dp_replicate=dp_replicate, dp_shard=world_size // dp_replicate, world_size=world_size)

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp(self) -> int:
        """Ranks that see different data (CP ranks share a sequence)."""
        return self.dp_replicate * self.dp_shard // self.cp

    def dp_rank(self, rank: int) -> int:
        """Data-parallel index of a global rank (the cp ranks of one sequence are consecutive)."""
        return rank // self.cp

    def cp_rank(self, rank: int) -> int:
        return rank % self.cp

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A 2-D ("dp_replicate", "dp_shard") mesh; FSDP shards over dp_shard and replicates over dp_replicate."""
        return init_device_mesh(
            device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
        )


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The mesh fully_shard gets: 2-D for HSDP (replicate, shard), else the 1-D shard dim."""
    return mesh if dims.dp_replicate_enabled else mesh["dp_shard"]


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
