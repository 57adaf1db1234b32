"""torchrun for one node whose rendezvous store listens on loopback only.

``python -m prime_rl.trainer.torchrun_loopback --nproc-per-node N -m module ...`` is
``torchrun --standalone ...`` except for where the agent's store listens: 127.0.0.1 instead of every
interface of the host. The store has no authentication, so on a shared host anyone who could reach it
could join or corrupt the trainer's process group while the run lasts.

Design decisions:
- Measured with torch 2.13 (CPU) and ``ss -ltnp``: ``TCPStore(host, port, is_master=True)`` listens on
  ``*:<port>`` whatever ``host`` (libuv and legacy backends), and torchrun builds its stores that way, so
  ``--standalone``, ``--rdzv-endpoint 127.0.0.1:<port>``, ``--local-addr`` and ``--master-addr 127.0.0.1``
  all listen on ``*``. A store given a listening socket (``master_listen_fd``) uses it as it is: this
  module binds one to 127.0.0.1 and hands it to the store in a rendezvous handler of its own,
  ``prime-rl-loopback`` (torchrun's ``static`` one, single node, with that store), registered before
  torchrun's own ``main`` runs. ``master_listen_fd`` needs the legacy backend (``use_libuv=False``): the
  libuv one aborted.
- The ranks use the agent's store (``use_agent_store``): they connect to 127.0.0.1 as clients and listen
  on nothing of torchrun's (gloo's own listeners were on 127.0.0.1 already).
- Left out: multi-node (SLURM) runs, whose store must be reachable from the other nodes; they keep
  torchrun's ``static`` rendezvous (see docs/DESIGN.md).
"""

from __future__ import annotations

import socket
import sys

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

RDZV_BACKEND = "prime-rl-loopback"
LOOPBACK = "127.0.0.1"


class LoopbackRendezvous(StaticTCPRendezvous):
    """torchrun's static rendezvous for one node, its store listening on a socket bound to 127.0.0.1."""

    def get_backend(self) -> str:
        return RDZV_BACKEND

    def next_rendezvous(self):
        if self._store is None:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((LOOPBACK, self.master_port))
            listener.listen(128)
            self.master_port = listener.getsockname()[1]
            self._store = TCPStore(
                LOOPBACK,
                self.master_port,
                self.world_size,
                True,
                self.timeout,
                multi_tenant=True,
                use_libuv=False,  # master_listen_fd needs the legacy backend: the libuv one aborted
                master_listen_fd=listener.detach(),  # the store owns the socket from here on
            )
        return super().next_rendezvous()


def create_handler(params: RendezvousParameters) -> LoopbackRendezvous:
    if params.max_nodes != 1:
        raise ValueError(
            f"--nnodes={params.max_nodes}: the loopback rendezvous serves one node; a multi-node run uses "
            "torchrun's static or c10d rendezvous on an address the other nodes reach"
        )
    timeout = int(params.config.get("timeout", 600))
    return LoopbackRendezvous(LOOPBACK, 0, 0, 1, params.run_id, timeout)


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.run import main as torchrun_main

    rendezvous_handler_registry.register(RDZV_BACKEND, create_handler)
    args = sys.argv[1:] if argv is None else argv
    torchrun_main(["--nnodes", "1", "--rdzv-backend", RDZV_BACKEND, "--rdzv-endpoint", f"{LOOPBACK}:0", *args])


if __name__ == "__main__":
    main()
