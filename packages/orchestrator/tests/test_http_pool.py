import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from prime_rl.orchestrator.http_pool import KEEPALIVE_EXPIRY_S, ShardedHTTP

TIMEOUT = httpx.Timeout(5.0)


def test_requests_go_round_robin_over_the_shards():
    async def go():
        http = ShardedHTTP(timeout=TIMEOUT, headers={}, max_connections=64, num_shards=4)
        seen: list[int] = []
        for i, client in enumerate(http.clients):

            async def record(url, i=i, **kwargs):
                seen.append(i)
                return httpx.Response(200)

            client.post = client.get = record
        await asyncio.gather(*(http.post("http://x/v1/chat/completions") for _ in range(8)), http.get("http://x/h"))
        await http.aclose()
        return seen

    assert asyncio.run(go()) == [0, 1, 2, 3, 0, 1, 2, 3, 0]


def test_shards_split_the_connection_limit_and_never_outnumber_it():
    async def go(max_connections: int, num_shards: int) -> list[int]:
        http = ShardedHTTP(timeout=TIMEOUT, headers={}, max_connections=max_connections, num_shards=num_shards)
        limits = [client._transport._pool._max_connections for client in http.clients]
        await http.aclose()
        return limits

    assert asyncio.run(go(1024, 32)) == [32] * 32
    assert asyncio.run(go(100, 32)) == [3] * 32  # at most 96 <= 100 in all
    assert asyncio.run(go(3, 32)) == [1, 1, 1]
    with pytest.raises(ValueError, match="max_connections=0: need at least 1"):
        asyncio.run(go(0, 32))


def test_the_client_answers_through_the_shards_as_before(openai_server):
    """Many requests at once through the sharded client: every answer is the server's for its own request."""
    from prime_rl.orchestrator.client import InferenceClient, SamplingArgs

    async def go():
        client = InferenceClient(openai_server.base_url, "tiny")
        try:
            messages = [[{"role": "user", "content": f"Reverse.\n{word}"}] for word in ("abc", "hello", "xy") * 20]
            return await asyncio.gather(
                *(client.sample(m, 2, SamplingArgs(max_tokens=16, temperature=1.0)) for m in messages)
            )
        finally:
            await client.aclose()

    results = asyncio.run(go())
    assert [r.completions[0].text for r in results] == ["cba", "olleh", "yx"] * 20
    assert len(openai_server.requests) == 60


class _KeepAliveServer:
    """HTTP/1.1 with keep-alive, like vLLM's uvicorn: records the client port of every request (one per connection)."""

    def __init__(self) -> None:
        self.ports: list[int] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep the connection open between requests

            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                server.ports.append(self.client_address[1])
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/x"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_idle_connections_are_dropped_before_the_servers_keep_alive_closes_them():
    """vLLM's server closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a request written to one at that
    moment fails with ReadError. The client reuses a connection idle for less than KEEPALIVE_EXPIRY_S (< 5 s) and
    opens a new one after that."""
    server = _KeepAliveServer()

    async def go():
        http = ShardedHTTP(timeout=TIMEOUT, headers={}, max_connections=1, num_shards=1)
        try:
            for pause in (0.2, KEEPALIVE_EXPIRY_S + 0.5):
                await http.post(server.url, json={})
                time.sleep(pause)  # idle, with no event loop turn that could close it earlier
            await http.post(server.url, json={})
        finally:
            await http.aclose()

    try:
        asyncio.run(go())
    finally:
        server.close()
    first, reused, after_idle = server.ports
    assert reused == first, "a connection idle for 0.2 s was not reused"
    assert after_idle != first, f"a connection idle for {KEEPALIVE_EXPIRY_S + 0.5} s was reused"
    assert KEEPALIVE_EXPIRY_S <= 4.0  # 1 s or more below vLLM's 5 s
