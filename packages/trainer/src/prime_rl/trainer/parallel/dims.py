"""Parallel layout: world = dp_replicate x dp_shard (HSDP); dp_shard is the FSDP island.

Context parallelism (cp) and expert parallelism (ep) split the island further: cp consecutive ranks
share one sequence (so `dp`, the ranks that see different data, is world // cp), and ep consecutive
ranks share one set of experts (ep is a multiple of cp under "auto", so a CP group never straddles two
EP groups).

Meshes: `ParallelDims.build_mesh` is the one place that builds a device mesh. Like torchtitan's
`ParallelDims`, it makes one 1-D "world" mesh and unflattens it into a view per layout, each view a
row-major split of the same ranks:

    ("dp_replicate", "dp_shard")   FSDP (the 1-D dp_shard) or HSDP (both)
    ("ep_replicate", "ep")         expert parallelism, only when ep > 1
    ("cp_outer", "cp")             context parallelism, only when cp > 1

and every consumer slices what it needs by name from the returned `WorldMesh` (`mesh["cp"]`,
`mesh["ep_replicate", "ep"]`). Why views and not one N-D mesh with flattened dims: an explicit ep and
cp need not nest (ep=2 with cp=3 on 6 ranks), and a single mesh can only hold groups that nest.
"""

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class WorldMesh:
    """The world mesh and its named views; `mesh[names]` is the sub-mesh of the view holding `names`."""

    world: DeviceMesh
    views: tuple[DeviceMesh, ...]

    @property
    def device_type(self) -> str:
        return self.world.device_type

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        wanted = (names,) if isinstance(names, str) else names
        for view in self.views:
            if set(wanted) <= set(view.mesh_dim_names):
                return view[names]
        built = [name for view in self.views for name in view.mesh_dim_names]
        raise KeyError(
            f"no mesh view holds {wanted}; this layout built {built} (the ep and cp views exist only when ep > 1 "
            "or cp > 1, and names from two views cannot be sliced together)"
        )


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

    def mesh_views(self) -> list[tuple[tuple[str, int], ...]]:
        """Each view's (name, size) dims, outermost first; the last dim groups consecutive ranks."""
        views = [(("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard))]
        if self.ep_enabled:  # ep consecutive ranks share one set of experts
            views.append((("ep_replicate", self.world_size // self.ep), ("ep", self.ep)))
        if self.cp_enabled:  # cp consecutive ranks share one sequence
            views.append((("cp_outer", self.world_size // self.cp), ("cp", self.cp)))
        return views

    def build_mesh(self, device_type: str) -> WorldMesh:
        """The world mesh, unflattened into the views of `mesh_views` (each view's process groups are made
        here, once, and shared by every model built on this mesh)."""
        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        views = tuple(
            world._unflatten(0, tuple(size for _, size in dims), tuple(name for name, _ in dims))
            for dims in self.mesh_views()
        )
        return WorldMesh(world, views)


def fsdp_mesh(mesh: WorldMesh, dims: ParallelDims) -> DeviceMesh:
    """The mesh fully_shard gets: 2-D for HSDP (replicate, shard), else the 1-D shard dim."""
    return mesh["dp_replicate", "dp_shard"] if dims.dp_replicate_enabled else mesh["dp_shard"]
