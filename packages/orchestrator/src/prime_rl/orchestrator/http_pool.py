"""HTTP connections to inference, spread over several httpx clients (one concern: request overhead at high fan-out).

Why not one `httpx.AsyncClient`: its connection pool (httpcore 1.0) walks every connection it holds, and asks each
one's socket for its state (anyio builds a dict of socket attributes, `getpeername` included, per call), every
time a request is queued or a response closes, and it counts the idle ones once per idle connection: quadratic in
the requests in flight. A synchronous step sends all of its groups at once and all of them finish together, so the
walk lands on the start and the tail of every step: 32 concurrent small requests took 300-470 ms through one client
on the 2-core development machine, 30-100 ms through 32 (and 3-7 ms over raw sockets; benchmarks/rollout_path.py,
BENCHMARKS.md). Round-robin over `num_shards` clients keeps each pool small, and the walk with it.

The clients share one TLS context: building one per client costs ~80 ms (certificate loading) each.

Idle connections are dropped after `KEEPALIVE_EXPIRY_S`, below the server's keep-alive: vLLM's HTTP server (uvicorn)
closes a connection idle for `VLLM_HTTP_TIMEOUT_KEEP_ALIVE` = 5 s, httpx's default keeps one 5 s too, and a
request written to a connection at the moment the server closes it fails with ReadError (retried after 0.5 s). The
README's example hit it 3 times in one run: with ~2.5 s steps and requests round-robin over the shards, a shard's
connection is idle for about two steps, ~5 s.
"""

from __future__ import annotations

import itertools
from typing import Any

import httpx

NUM_SHARDS = 32
"""Clients the requests are spread over; requests in flight / NUM_SHARDS connections in each pool."""

KEEPALIVE_EXPIRY_S = 3.0
"""An idle connection is closed by the client after this long: 2 s before vLLM's server would close it."""


class ShardedHTTP:
    """The `get` / `post` / `aclose` of `httpx.AsyncClient`, round-robin over `num_shards` clients (fewer when
    `max_connections` is smaller) that together hold at most `max_connections` connections."""

    def __init__(
        self,
        *,
        timeout: httpx.Timeout,
        headers: dict[str, str],
        max_connections: int,
        num_shards: int = NUM_SHARDS,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections={max_connections}: need at least 1 connection to inference")
        num_shards = min(num_shards, max_connections)  # every shard needs a connection of its own
        per_shard = max_connections // num_shards
        limits = httpx.Limits(
            max_connections=per_shard, max_keepalive_connections=per_shard, keepalive_expiry=KEEPALIVE_EXPIRY_S
        )
        tls = httpx.create_ssl_context()  # what each client would build for itself (certifi, SSL_CERT_FILE/DIR)
        self.clients = [
            httpx.AsyncClient(timeout=timeout, headers=headers, limits=limits, verify=tls) for _ in range(num_shards)
        ]
        self._next = itertools.cycle(self.clients)

    async def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return await next(self._next).get(url, **kwargs)

    async def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return await next(self._next).post(url, **kwargs)

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()
