"""A process group shared by one trainer rank and the inference workers, outside torch's global state.

Both ends build the same thing from a TCP store: the trainer is rank 0 (it hosts the store), inference
worker ``i`` is rank ``rank_offset + i``. The group is a bare gloo or NCCL backend object rather than
``torch.distributed.init_process_group``: vLLM's workers and a torchrun trainer already own the global
default group, and a second one must not disturb it.

The trainer package builds the identical group in ``prime_rl.trainer.weights.broadcast`` (it may not
import this package); keep the two in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Keys in the TCP store are namespaced so the store could be shared with other rendezvous users.
STORE_PREFIX = "prime_rl/weight_broadcast"


@dataclass
class WeightGroup:
    """The group plus the TCP store it was built from (rank 0's store hosts the rendezvous server)."""

    pg: dist.ProcessGroup
    store: dist.TCPStore
    device: torch.device
    rank: int
    world_size: int

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Receive (or, on rank 0, send) ``tensor`` in place from rank 0."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        self.pg.shutdown()


def build_weight_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> WeightGroup:
    """Join the weight-broadcast group; blocks until all ``world_size`` ranks have joined."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight broadcast backend={backend!r} is not supported; use 'gloo' (CPU) or 'nccl' (GPU)")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    prefix_store = dist.PrefixStore(STORE_PREFIX, store)
    pg = dist.ProcessGroup(prefix_store, rank, world_size)
    if backend == "gloo":
        backend_obj = dist.ProcessGroupGloo(prefix_store, rank, world_size, timeout)
        backend_type, device = dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend_obj = dist.ProcessGroupNCCL(prefix_store, rank, world_size, options)
        backend_type, device = dist.ProcessGroup.BackendType.NCCL, torch.device("cuda", torch.cuda.current_device())
    pg._set_default_backend(backend_type)
    backend_obj._set_sequence_number_for_group()
    pg._register_backend(device, backend_type, backend_obj)
    group = WeightGroup(pg=pg, store=store, device=device, rank=rank, world_size=world_size)
    # A first tiny collective makes every rank wait here until the whole group is up.
    group.broadcast(torch.ones(1, device=device))
    return group
