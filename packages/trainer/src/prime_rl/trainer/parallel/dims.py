"""Parallel layout: world = dp_replicate x dp_shard (HSDP). EP and CP get their own mesh dims later."""

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int

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
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

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
