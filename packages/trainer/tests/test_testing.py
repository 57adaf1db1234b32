"""`run_on_ranks`, the harness of the distributed tests: results in rank order, a failing rank named with its
traceback (its peer, stuck in a collective, does not hang the test), a timeout instead of a hang."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from prime_rl.trainer.testing import RankFailed, one_rank_group, run_on_ranks

pytestmark = pytest.mark.multiprocess  # several processes: the dev-venv suite runs them


def _whoami(scale: int) -> tuple[int, int, str, str, str, float, int]:
    t = torch.ones(1)
    dist.all_reduce(t)  # the group is up and spans every rank
    env = os.environ
    return (
        dist.get_rank(), dist.get_world_size(), env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"],
        t.item(), scale * dist.get_rank(),
    )  # fmt: skip


def _rank_one_raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 waits for a peer that never comes


def _sleeps() -> None:
    time.sleep(3600)


def test_results_come_back_in_rank_order_with_the_group_and_env_set():
    assert run_on_ranks(_whoami, 3, 10) == [
        (0, 3, "0", "0", "3", 3.0, 0),
        (1, 3, "1", "1", "3", 3.0, 10),
        (2, 3, "2", "2", "3", 3.0, 20),
    ]


def test_a_raising_rank_is_reported_with_its_rank_and_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 of 2 running _rank_one_raises raised") as failed:
        run_on_ranks(_rank_one_raises, 2, timeout=120)
    assert failed.value.rank == 1
    assert "ValueError: rank one is broken" in str(failed.value)
    assert "Traceback" in str(failed.value)
    assert time.monotonic() - start < 100  # reported when it happened, not at the timeout


def test_ranks_that_do_not_finish_time_out():
    with pytest.raises(RankFailed, match=r"ranks \[0, 1\] did not finish within timeout=15s"):
        run_on_ranks(_sleeps, 2, timeout=15)


def test_one_rank_group_is_a_world_of_one():
    with one_rank_group() as world:
        assert (world.rank, world.world_size, dist.get_world_size()) == (0, 1, 1)
    assert not dist.is_initialized()
