"""Start distributed code the way tests do: N local gloo ranks on CPU, one thread each.

Two forms, one for each kind of distributed test:

- `torchrun(script, ..., nproc=N)` runs a *script* (or ``-m module``) under the launcher the entrypoints use
  (`prime_rl.trainer.torchrun_loopback`: the rendezvous store on 127.0.0.1, as `rl` and `sft` run). For tests
  of an entrypoint or of a worker script that must start the way a real rank does.
- `run_on_ranks(fn, N, *args)` runs a module-level *function* on N spawned ranks, the process group already
  initialised, and returns what each rank returned. For tests of a distributed building block (a collective,
  a source that broadcasts): no script file, no result files, and a rank's exception comes back as the
  test's failure.

Both start one intra-op thread per rank (2 ranks on 2 cores would otherwise oversubscribe), stop at a
timeout instead of hanging, and fail with what went wrong on which rank.

`one_rank_group()` is the in-process form for code that only needs a default process group (world size 1).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from prime_rl.common.commands import TORCHRUN_LOOPBACK
from prime_rl.common.net import free_port
from prime_rl.trainer.world import World, exit_rank

T = TypeVar("T")


def torchrun(
    *argv: str | os.PathLike[str],
    nproc: int,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    check: bool = True,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (a script and its arguments, or ``"-m", module, ...``) on ``nproc`` local ranks.

    ``env`` is added to this process's environment (OMP_NUM_THREADS=1 unless given). With ``check`` a
    non-zero exit fails the calling test with the tail of both streams; the finished process is returned.
    """
    # Not `commands.torchrun_loopback_command`: that one runs `-m module @ config` with rank 0's console only;
    # a test runs a script with its own arguments and wants every rank's output when it fails.
    cmd = [sys.executable, "-m", TORCHRUN_LOOPBACK, "--nproc-per-node", str(nproc), *(str(a) for a in argv)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{nproc} ranks of {' '.join(str(a) for a in argv[:3])} exited {proc.returncode}:\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


class RankFailed(AssertionError):
    """A rank of `run_on_ranks` raised, died or did not finish in time; ``rank`` says which (the first seen)."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


def run_on_ranks(
    fn: Callable[..., T],
    nproc: int,
    *args: Any,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    ranks_per_node: int | None = None,
) -> list[T]:
    """``fn(*args)`` on ``nproc`` spawned gloo ranks on CPU; each rank's return value, in rank order.

    ``fn`` must be a module-level function (spawn imports it by name) and ``args`` and its result picklable.
    Each rank has RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT set (plus
    ``env``) and the default process group initialised around ``fn`` (and destroyed after it). The ranks are
    one node, or nodes of ``ranks_per_node`` ranks each as torchrun numbers them (LOCAL_RANK = rank % it).

    The first rank to raise fails the call with its traceback (the others are terminated: they may be
    waiting in a collective for it); so does a rank that dies without answering, and ``timeout`` seconds
    without every answer (counted from the start, spawning included).
    """
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, args, rank, nproc, ranks_per_node or nproc, port, env or {}, timeout, answers),
            daemon=True,
        )
        for rank in range(nproc)
    ]
    for p in procs:
        p.start()
    name = getattr(fn, "__qualname__", repr(fn))
    results: dict[int, T] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < nproc:
            try:
                rank, ok, payload = answers.get(timeout=min(0.5, max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                # A rank's answer is in the pipe before its process exits, so dead-and-silent is checked after
                # one more drain: a rank that answered and then exited is not mistaken for one that died.
                dead = {r: p.exitcode for r, p in enumerate(procs) if r not in results and p.exitcode is not None}
                if dead:
                    try:
                        rank, ok, payload = answers.get(timeout=1.0)
                    except queue.Empty:
                        rank, code = min(dead.items())
                        raise RankFailed(
                            rank, f"rank {rank} of {nproc} running {name} exited {code} without an answer"
                        ) from None
                elif time.monotonic() >= deadline:
                    waiting = [r for r in range(nproc) if r not in results]
                    raise RankFailed(
                        waiting[0],
                        f"{name} on {nproc} ranks: ranks {waiting} did not finish within timeout={timeout}s "
                        "(a rank stuck in a collective, or a slow machine: raise timeout)",
                    ) from None
                else:
                    continue
            if not ok:
                raise RankFailed(rank, f"rank {rank} of {nproc} running {name} raised:\n{payload}")
            results[rank] = pickle.loads(payload)
        for p in procs:  # every rank answered: give them a moment to tear their group down
            p.join(5)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        answers.close()
    return [results[r] for r in range(nproc)]


def _rank_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    nproc: int,
    ranks_per_node: int,
    port: int,
    env: dict[str, str],
    timeout: float,
    answers: Any,
) -> None:
    """One rank of `run_on_ranks`: answers ``(rank, True, pickled result)`` or ``(rank, False, traceback)``."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank % ranks_per_node), WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(ranks_per_node),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", **env,
    )  # fmt: skip
    torch.set_num_threads(1)
    try:
        # The group's own timeout too: a collective whose peer is gone errors out instead of waiting forever.
        dist.init_process_group("gloo", rank=rank, world_size=nproc, timeout=timedelta(seconds=timeout))
        # Pickled here with plain pickle: multiprocessing's pickler would hand tensors over in shared memory
        # that this process owns, and it exits right after.
        answer = (rank, True, pickle.dumps(fn(*args)))
    except BaseException:  # noqa: BLE001 - any failure, SystemExit included, is the test's answer
        answer = (rank, False, traceback.format_exc())
    answers.put(answer)
    answers.close()
    answers.join_thread()  # the answer is in the pipe before this process is gone
    # Torn down only after answering: a peer waiting in a collective fails when this rank's group goes away,
    # and its answer ("connection reset") must come after this one's, the cause.
    if dist.is_initialized():
        dist.destroy_process_group()
    exit_rank(0)  # skips interpreter finalization (gloo threads can abort it; see `exit_rank`)


@contextmanager
def one_rank_group() -> Iterator[World]:
    """A default gloo process group of this process alone (world size 1, CPU) for the ``with`` block."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield World(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()
