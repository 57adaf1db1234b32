import asyncio

import httpx
import pytest

from prime_rl.orchestrator.http_pool import ShardedHTTP

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
