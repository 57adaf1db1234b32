"""Control requests to every inference server at once: the one fan-out behind every transport's loading.

A weight version is loaded by control requests sent to every inference server, and which requests, in what order
and from which side is one row of ``prime_rl.common.weight_transports.TRANSPORTS``: the orchestrator sends the
filesystem transport's (``PauseRequest``, ``LoadWeightsRequest``, ``ResumeRequest``: it closes its request gate
around them), trainer rank 0 the push transports' (the begin request, then ``AwaitWeightsRequest`` once its bytes
went out). Both send them through ``ServerSet``; the policy for a failed reply stays with the caller (the trainer
raises the first; the orchestrator tells a refusal from a server that went away and heals the latter).

One thread per server, not a shared pool: a server answers some requests only once its workers are done (a
broadcast's begin, the await), so every server must be working on its request at the same time, however many
there are. Torch-free (ZeroMQ and the wire messages only).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from prime_rl.common.transport import ControlClient, PeerLostError
from prime_rl.common.wire import Message

Reply = Message | BaseException
"""A server's answer to one request, or what kept it from answering (timeout, lost connection)."""

Requests = Message | Callable[[int], Message]
"""One request for every server, or ``make_request(i)`` for server ``i``."""


class ServerSet:
    """One ``ControlClient`` per inference server control address, in the given order."""

    def __init__(
        self,
        addresses: Sequence[str],
        timeout_s: float,
        *,
        watch_peer: bool = False,
        error: type[Exception] = RuntimeError,
    ) -> None:
        self.addresses = list(addresses)
        self.error = error
        """Raised by ``start``/``request`` (the caller's error type) when a server refuses or fails."""
        self.clients = [ControlClient(a, timeout_s=timeout_s, watch_peer=watch_peer) for a in self.addresses]
        self.endpoints = [client.endpoint for client in self.clients]

    def begin(
        self, requests: Requests, indices: Sequence[int] | None = None, fail_fast: bool = False
    ) -> Callable[[], list[Reply]]:
        """Send ``requests`` (or ``make_request(i)`` to server ``i``) to each server in ``indices`` (all by default)
        in the background; call the result to wait for every answer (in ``indices`` order). None is lost: each
        server's answer is awaited, not just the first failure, so none is left in the middle of an update.
        ``fail_fast``: a server whose connection is known to be down (``watch_peer``) is not sent the request; its
        answer is a ``PeerLostError``."""
        indices = list(range(len(self.clients))) if indices is None else list(indices)
        make_request = requests if callable(requests) else lambda i: requests
        replies: list[Reply | None] = [None] * len(indices)

        def call(slot: int, i: int, request: Message) -> None:
            client = self.clients[i]
            try:
                if fail_fast and client.peer_gone:
                    raise PeerLostError(
                        f"{client.endpoint} went away before {type(request).__name__}: its connection is down"
                    )
                replies[slot] = client.request(request)
            except BaseException as e:  # the caller decides what a failure means
                replies[slot] = e

        threads = []
        for slot, i in enumerate(indices):
            thread = threading.Thread(target=call, args=(slot, i, make_request(i)), daemon=True, name=f"control-{i}")
            thread.start()
            threads.append(thread)

        def join() -> list[Reply]:
            for thread in threads:
                thread.join()
            return replies  # type: ignore[return-value]  # every slot was set by its thread

        return join

    def gather(self, requests: Requests, indices: Sequence[int] | None = None, fail_fast: bool = False) -> list[Reply]:
        """``begin(...)()``: send and wait for every answer."""
        return self.begin(requests, indices, fail_fast)()

    def start(self, requests: Requests, what: str | None = None) -> Callable[[], list[Message]]:
        """``begin`` for every server; the result waits, then raises ``error`` naming the request (``what``; by
        default its type) and the first server (in address order) that refused it or did not answer."""
        join = self.begin(requests)
        if what is None:
            what = type(requests).__name__ if isinstance(requests, Message) else "control request"

        def checked() -> list[Message]:
            replies = join()
            for reply, address in zip(replies, self.addresses):
                if getattr(reply, "ok", False) is not True:
                    reason = getattr(reply, "error", None) or repr(reply)
                    raise self.error(f"{what} refused by inference server {address}: {reason}")
            return replies  # type: ignore[return-value]

        return checked

    def request(self, requests: Requests, what: str | None = None) -> list[Message]:
        """Send to every server and wait; raises like ``start``."""
        return self.start(requests, what)()

    def close(self) -> None:
        for client in self.clients:
            client.close()
