"""The trainer's announcement of every new policy version to the orchestrator (``WeightsPublished``).

The trainer (global rank 0) connects a ZeroMQ PUSH socket to the orchestrator's PULL socket
(``weight_broadcast.announce`` = ``tcp://host:port``, the orchestrator's ``trainer.weights_port``)
and sends one message per version, only once that version is complete: written and renamed into place
(filesystem) or loaded by every inference server (nccl, nixl). The orchestrator bounds staleness with
these announcements alone; nothing polls the file system.

Unlike the batch ``Sender`` this socket queues instead of blocking while no orchestrator is connected
(no ZMQ_IMMEDIATE): an announcement sent before the orchestrator binds, or while it restarts, is
delivered when it (re)connects, and a trainer that outlives the orchestrator (its last version, which
nobody waits for) is never stuck: ``close`` gives the queue ``linger_s`` seconds, then drops it.
The socket has its own ZeroMQ context, which ``close`` terminates: closing a socket only hands its queue
to ZeroMQ's I/O thread, and a trainer rank ends with ``os._exit`` (``exit_rank``), which would kill that
thread with the last announcement still queued (seen in CI: the final version never reached the
orchestrator). Terminating the context is what waits for delivery, bounded by the linger.

Torch-free (wire + transport), but lives here beside the publishers that call it.
"""

from __future__ import annotations

import logging

import zmq

from prime_rl.common.transport import Sender
from prime_rl.common.wire import WeightsPublished

logger = logging.getLogger(__name__)


class VersionAnnouncer:
    """Sends ``WeightsPublished`` to the orchestrator; ``endpoint=None`` announces nothing (benchmarks).

    ``timeout_s`` bounds a send only when the queue is full (1000 unsent announcements)."""

    def __init__(self, endpoint: str | None, timeout_s: float = 600.0, linger_s: float = 10.0) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._context: zmq.Context | None = None
        self._sender: Sender | None = None
        if endpoint:
            self._context = zmq.Context()
            self._sender = Sender(
                endpoint, timeout_s=timeout_s, linger_s=linger_s, context=self._context, queue_without_peer=True
            )

    def announce(self, version: int, path: str | None = None, publish_s: float = 0.0, write_s: float = 0.0) -> None:
        """Tell the orchestrator ``version`` exists: at ``path`` (to load), or already served (``path=None``)."""
        if self._sender is None:
            return
        message = WeightsPublished(version=version, path=path, publish_s=publish_s, write_s=write_s)
        try:
            self._sender.send(message)
        except TimeoutError as e:
            raise TimeoutError(
                f"could not announce policy version {version} to the orchestrator at {self.endpoint} within "
                f"{self.timeout_s}s: {e}; is the orchestrator running with trainer.weights_port set to this port?"
            ) from e

    def close(self) -> None:
        """Close the socket and wait (at most ``linger_s``) until queued announcements are delivered."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None
            self._context.term()  # returns once the queue is sent, or dropped after the linger
            self._context = None
