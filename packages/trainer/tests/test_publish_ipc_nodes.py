"""ipc across the nodes of a colocated SLURM job: which rank leads each node, which servers each leader pushes
into, where it hosts its bucket channel, and which nodes a failed version names. The publish itself over
several gloo "nodes" against stand-in servers: tests/test_ipc_per_node.py."""

import pytest
import torch

from prime_rl.trainer.rl.publish_ipc import node_channel, node_failures, node_servers
from prime_rl.trainer.world import World

CPU = torch.device("cpu")


def test_torchrun_numbers_ranks_node_by_node():
    worlds = [World(rank=r, local_rank=r % 2, world_size=4, device=CPU, local_world_size=2) for r in range(4)]
    assert [w.node_rank for w in worlds] == [0, 0, 1, 1]
    assert [w.is_node_leader for w in worlds] == [True, False, True, False]
    assert {w.num_nodes for w in worlds} == {2}


def test_a_world_without_a_local_size_is_one_node():
    world = World(rank=3, local_rank=3, world_size=4, device=CPU)  # tests and callers that predate nodes
    assert (world.num_nodes, world.node_rank, world.is_node_leader) == (1, 0, False)


def test_each_node_leader_pushes_into_its_own_nodes_servers():
    one_each = ["tcp://n0:8100", "tcp://n1:8101"]
    assert [node_servers(one_each, 2, node) for node in (0, 1)] == [["tcp://n0:8100"], ["tcp://n1:8101"]]
    # replicas per node (router.replicas > 1): CONTROL_ADDRS lists a node's replicas together
    two_each = ["tcp://n0:8100", "tcp://n0:8101", "tcp://n1:8102", "tcp://n1:8103"]
    assert node_servers(two_each, 2, 1) == ["tcp://n1:8102", "tcp://n1:8103"]
    assert node_servers(two_each, 1, 0) == two_each  # one node: every server, as before


@pytest.mark.parametrize("addresses", [[], ["tcp://n0:8100", "tcp://n1:8101", "tcp://n1:8102"]])
def test_addresses_that_do_not_split_into_nodes_are_refused(addresses):
    with pytest.raises(ValueError, match=rf"lists {len(addresses)} server\(s\) for 2 nodes: .* node by node"):
        node_servers(addresses, 2, 0)


def test_one_node_keeps_the_configured_channel_and_several_get_one_port_each_on_loopback():
    assert node_channel("train-head", 29720, 1, 0) == ("train-head", 29720)
    # two nodes that are one machine (the local SLURM cluster) must not bind the same port
    assert [node_channel("train-head", 29720, 2, node) for node in (0, 1)] == [
        ("127.0.0.1", 29720),
        ("127.0.0.1", 29721),
    ]


def test_a_failed_version_names_the_nodes_whose_leader_failed():
    errors = [None, None, "IpcWeightError: refused", None, None, None]  # 3 nodes x 2 ranks: node 1's leader
    assert node_failures(errors, 2) == {1: "IpcWeightError: refused"}
    assert node_failures([None] * 6, 2) == {}
