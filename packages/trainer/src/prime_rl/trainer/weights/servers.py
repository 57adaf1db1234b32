"""The trainer's control connection to every inference server (torch-free, shared by the push transports)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from prime_rl.common.transport import ControlClient
from prime_rl.common.wire import Message


class InferenceServers:
    """One ``ControlClient`` per server; every request goes to all of them at once, one thread each
    (a server answers some requests only when its workers are done, and they must all be working)."""

    def __init__(self, addresses: Sequence[str], timeout_s: float, error: type[Exception]) -> None:
        self.addresses = list(addresses)
        self.error = error
        self.clients = [ControlClient(a, timeout_s=timeout_s) for a in self.addresses]

    def start(self, make_request: Callable[[int], Message], what: str) -> Callable[[], list[Message]]:
        """Send request ``make_request(i)`` to server ``i`` in the background; call the result to wait
        for every reply (raises ``error`` naming the first server that refused or failed)."""
        replies: list[object] = [None] * len(self.clients)

        def call(i: int) -> None:
            try:
                replies[i] = self.clients[i].request(make_request(i))
            except Exception as e:  # reported by join with the server's address
                replies[i] = e

        threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(self.clients))]
        for t in threads:
            t.start()

        def join() -> list[Message]:
            for t in threads:
                t.join()
            for reply, address in zip(replies, self.addresses):
                if getattr(reply, "ok", False) is not True:
                    reason = getattr(reply, "error", None) or repr(reply)
                    raise self.error(f"{what} refused by inference server {address}: {reason}")
            return replies  # type: ignore[return-value]

        return join

    def request(self, make_request: Callable[[int], Message], what: str) -> list[Message]:
        """Send and wait: ``start(...)()``."""
        return self.start(make_request, what)()

    def close(self) -> None:
        for client in self.clients:
            client.close()
