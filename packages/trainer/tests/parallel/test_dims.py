"""`ParallelDims.build_mesh`'s named views put every rank in the same groups as the three meshes built
before it (the FSDP mesh in dims.py, the EP mesh in expert.py, the CP mesh in context.py), rebuilt here as
they were.

One process plays each rank in turn on torch's fake process group: making a mesh makes its groups and
nothing more, so no rank has to run. The end-to-end check (the features on these meshes against one
process, over gloo) is test_scaling.py.
"""

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from prime_rl.trainer.parallel.dims import ParallelDims, WorldMesh, fsdp_mesh

LAYOUTS = {  # name: (dp_replicate, dp_shard, cp, ep)
    "fsdp": (1, 4, 1, 1),
    "dp_shard x cp x ep": (1, 8, 2, 4),
    "cp wider than ep": (1, 8, 4, 2),
    "ep and cp that do not nest": (1, 6, 3, 2),
    "hsdp": (2, 4, 1, 1),
    "hsdp x cp x ep": (2, 4, 2, 2),
}


def _old_meshes(dims: ParallelDims) -> dict[str, DeviceMesh]:
    """The meshes as built before one world mesh: each consumer called init_device_mesh itself."""
    dense = init_device_mesh("cpu", (dims.dp_replicate, dims.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard"))
    meshes = {"fsdp": dense if dims.dp_replicate_enabled else dense["dp_shard"], "dp_replicate": dense}
    if dims.ep_enabled:
        ep_shape = (dims.world_size // dims.ep, dims.ep)
        meshes["ep"] = init_device_mesh("cpu", ep_shape, mesh_dim_names=("ep_replicate", "ep"))
    if dims.cp_enabled:
        cp_shape = (dims.world_size // dims.cp, dims.cp)
        meshes["cp"] = init_device_mesh("cpu", cp_shape, mesh_dim_names=("cp_outer", "cp"))["cp"]
    return meshes


def _new_meshes(dims: ParallelDims, mesh: WorldMesh) -> dict[str, DeviceMesh]:
    """What each consumer slices from the world mesh now (parallelize.py)."""
    meshes = {"fsdp": fsdp_mesh(mesh, dims), "dp_replicate": mesh["dp_replicate", "dp_shard"]}
    if dims.ep_enabled:
        meshes["ep"] = mesh["ep_replicate", "ep"]
    if dims.cp_enabled:
        meshes["cp"] = mesh["cp"]
    return meshes


def _groups(mesh: DeviceMesh) -> tuple:
    """The mesh as the consumer sees it: its names, its rank grid, and this rank's group per dim."""
    ranks = tuple(tuple(dist.get_process_group_ranks(mesh.get_group(d))) for d in range(mesh.ndim))
    return mesh.mesh_dim_names, mesh.mesh.tolist(), ranks


def _as_rank(rank: int, world_size: int):
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_every_named_view_has_the_groups_of_the_mesh_it_replaces(layout):
    dp_replicate, dp_shard, cp, ep = layout
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, world_size=dp_replicate * dp_shard, cp=cp, ep=ep)
    for rank in range(dims.world_size):
        _as_rank(rank, dims.world_size)
        try:
            old = {name: _groups(m) for name, m in _old_meshes(dims).items()}
            new = {name: _groups(m) for name, m in _new_meshes(dims, dims.build_mesh("cpu")).items()}
        finally:
            dist.destroy_process_group()
        assert new == old, f"rank {rank}"


def test_the_groups_by_hand():
    """dp_shard=8 x cp=2 x ep=4 on rank 5: the whole island shards, 4-5 share a sequence, 4-7 the experts."""
    dims = ParallelDims(dp_replicate=1, dp_shard=8, world_size=8, cp=2, ep=4)
    _as_rank(5, 8)
    try:
        mesh = dims.build_mesh("cpu")
        groups = {
            n: dist.get_process_group_ranks(mesh[n].get_group()) for n in ("dp_shard", "cp", "ep", "ep_replicate")
        }
    finally:
        dist.destroy_process_group()
    assert groups == {"dp_shard": list(range(8)), "cp": [4, 5], "ep": [4, 5, 6, 7], "ep_replicate": [1, 5]}


def test_a_view_that_was_not_built_is_named_in_the_error():
    dims = ParallelDims(dp_replicate=1, dp_shard=2, world_size=2)
    _as_rank(0, 2)
    try:
        mesh = dims.build_mesh("cpu")
        with pytest.raises(
            KeyError, match=r"no mesh view holds \('ep',\); this layout built \['dp_replicate', 'dp_shard'\]"
        ):
            mesh["ep"]
    finally:
        dist.destroy_process_group()
