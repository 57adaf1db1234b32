import asyncio
import time

import pytest

from prime_rl.common.config.orchestrator import ClientConfig
from prime_rl.orchestrator.client import (
    InferenceClient,
    InferenceError,
    InferenceUnreachableError,
    PromptTooLongError,
    SamplingArgs,
    resolve_api,
)

MESSAGES = [{"role": "user", "content": "Reverse this.\nabc"}]


def test_sample_returns_token_ids_and_logprobs(openai_server):
    async def go():
        client = InferenceClient(openai_server.base_url, "tiny")
        try:
            return await client.sample(MESSAGES, 3, SamplingArgs(max_tokens=16, temperature=0.7))
        finally:
            await client.aclose()

    result = asyncio.run(go())
    body = openai_server.requests[0]
    assert body["return_token_ids"] and body["logprobs"] and body["n"] == 3 and body["temperature"] == 0.7
    assert result.prompt_ids and all(isinstance(t, int) for t in result.prompt_ids)
    assert [c.text for c in result.completions] == ["cba", "ba", "a"]
    for c in result.completions:
        assert len(c.token_ids) == len(c.logprobs) and c.finish_reason == "stop"


def test_every_sampling_parameter_is_sent_explicitly(openai_server):
    """Left out, vLLM would take top_k / top_p / min_p / penalties from the model's generation_config.json."""
    from prime_rl.common.config.orchestrator import SamplingConfig

    sampling = SamplingArgs.from_config(SamplingConfig(temperature=0.7, max_tokens=12, stop=["\n\n"], seed=5))

    async def go():
        client = InferenceClient(openai_server.base_url, "tiny")
        try:
            return await client.sample(MESSAGES, 2, sampling)
        finally:
            await client.aclose()

    asyncio.run(go())
    body = openai_server.requests[0]
    expected = dict(temperature=0.7, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                    frequency_penalty=0.0, max_tokens=12, stop=["\n\n"], seed=5)  # fmt: skip
    assert {k: body[k] for k in expected} == expected


def test_unreachable_server_retries_with_backoff_then_names_the_url(ports):
    url = f"http://127.0.0.1:{ports.closed()}/v1"

    async def go():
        client = InferenceClient(url, "tiny", max_retries=3, retry_backoff=0.05, max_backoff=0.1)
        try:
            await client.sample(MESSAGES, 1, SamplingArgs(max_tokens=4, temperature=1.0))
        finally:
            await client.aclose()

    start = time.monotonic()
    with pytest.raises(InferenceUnreachableError) as info:
        asyncio.run(go())
    elapsed = time.monotonic() - start
    assert url in str(info.value) and "4 attempts" in str(info.value) and "base_url" in str(info.value)
    assert elapsed >= 0.05 + 0.1 + 0.1 - 0.02  # backoff 0.05, 0.1, then capped at 0.1


def test_5xx_is_retried_then_succeeds(make_server):
    server = make_server(fail_first=2)

    async def go():
        client = InferenceClient(server.base_url, "tiny", max_retries=3, retry_backoff=0.01)
        try:
            return await client.sample(MESSAGES, 1, SamplingArgs(max_tokens=8, temperature=1.0))
        finally:
            await client.aclose()

    assert asyncio.run(go()).completions[0].text == "cba"
    assert len(server.requests) == 3


def test_4xx_fails_at_once(make_server):
    server = make_server()

    async def go():
        client = InferenceClient(server.base_url.replace("/v1", "/nope"), "tiny", max_retries=5, retry_backoff=5.0)
        try:
            await client.sample(MESSAGES, 1, SamplingArgs(max_tokens=8, temperature=1.0))
        finally:
            await client.aclose()

    start = time.monotonic()
    with pytest.raises(InferenceError, match="HTTP 404"):
        asyncio.run(go())
    # one request and no back-off (a retry would sleep 5 s first); the bound leaves room for a loaded CI machine
    assert time.monotonic() - start < 4.0 and len(server.requests) == 1


def test_a_prompt_over_max_model_len_is_refused_as_too_long_at_once(make_server):
    """vLLM's 400 for a prompt that alone exceeds max_model_len is its own error (the scheduler skips the task),
    not retried; any other 4xx stays a plain InferenceError."""
    server = make_server(max_prompt_chars=10)

    async def go():
        client = InferenceClient(server.base_url, "tiny", max_retries=5, retry_backoff=1.0)
        try:
            await client.sample(MESSAGES, 1, SamplingArgs(max_tokens=8, temperature=1.0))
        finally:
            await client.aclose()

    with pytest.raises(PromptTooLongError, match="HTTP 400.*maximum context length is 10 tokens"):
        asyncio.run(go())
    assert len(server.requests) == 1


def test_routed_experts_are_decoded_from_vllms_base64_npy():
    """vLLM (0.26 and 0.32) puts each choice's routed experts as base64 `.npy` bytes of (tokens - 1, layers, k)."""
    import base64
    import io

    import numpy as np

    from prime_rl.orchestrator.client import parse_chat_response

    experts = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2)
    buffer = io.BytesIO()
    np.save(buffer, experts)
    choice = {"index": 0, "token_ids": [7, 8, 2], "logprobs": {"content": [{"logprob": -1.0}] * 3}}
    data = {
        "prompt_token_ids": [1, 2, 3],
        "choices": [{**choice, "routed_experts": base64.b64encode(buffer.getvalue()).decode()}],
    }
    (completion,) = parse_chat_response(data, 1).completions
    np.testing.assert_array_equal(completion.routed_experts, experts)
    (bare,) = parse_chat_response({**data, "choices": [choice]}, 1).completions
    assert bare.routed_experts is None
    with pytest.raises(InferenceError, match="routed_experts has shape"):
        buffer = io.BytesIO()
        np.save(buffer, experts[0])
        parse_chat_response(
            {**data, "choices": [{**choice, "routed_experts": base64.b64encode(buffer.getvalue()).decode()}]}, 1
        )


def test_the_samples_request_carries_every_sampling_parameter_and_decodes_as_the_servers_schema():
    """api = "samples": the body the server decodes strictly (unknown fields refused), with every sampling parameter
    pinned as in the chat request (the route takes none from generation_config.json)."""
    import msgspec

    from prime_rl.common.config.orchestrator import SamplingConfig
    from prime_rl.common.wire import SamplesRequest

    client = InferenceClient("http://127.0.0.1:1/v1", "tiny", api="samples")
    sampling = SamplingArgs.from_config(SamplingConfig(temperature=0.7, max_tokens=12, stop=["\n\n"], seed=5))
    body = client.build_samples_request([1, 2, 3], 4, sampling)
    request = msgspec.json.decode(msgspec.json.encode(body), type=SamplesRequest)
    chat = client.build_request(MESSAGES, 4, sampling)
    for field in SamplesRequest.__struct_fields__:
        if field in chat:
            assert getattr(request, field) == chat[field], field
    assert request.prompt_token_ids == [1, 2, 3] and request.n == 4
    asyncio.run(client.aclose())


def test_every_sampling_knob_has_one_name_from_the_config_to_the_samples_route():
    """``wire.SAMPLING_KNOBS`` is read by name from the config, the client's arguments and the route's request."""
    import dataclasses

    from prime_rl.common.config.orchestrator import SamplingConfig
    from prime_rl.common.wire import SAMPLING_KNOBS, SamplesRequest

    for fields in (SamplingConfig.model_fields, {f.name for f in dataclasses.fields(SamplingArgs)},
                   SamplesRequest.__struct_fields__):  # fmt: skip
        assert set(SAMPLING_KNOBS) <= set(fields), set(SAMPLING_KNOBS) - set(fields)


def test_a_samples_response_is_checked_before_it_becomes_completions():
    import array

    import msgspec

    from prime_rl.common.wire import Sample, SamplesResponse
    from prime_rl.orchestrator.client import parse_samples_response

    def body(*samples: Sample) -> bytes:
        return msgspec.json.encode(SamplesResponse(prompt_token_ids=[7, 8], samples=list(samples)))

    ok = Sample(array.array("i", [4, 5]).tobytes(), array.array("f", [-0.25, -1.5]).tobytes(), "hi", "stop")
    (completion,) = parse_samples_response(body(ok), 1).completions
    assert (completion.token_ids, completion.logprobs, completion.text) == ([4, 5], [-0.25, -1.5], "hi")
    with pytest.raises(InferenceError, match="asked for n=2 samples, got 1"):
        parse_samples_response(body(ok), 2)
    short = Sample(ok.token_ids, array.array("f", [-0.25]).tobytes(), "hi", "stop")
    with pytest.raises(InferenceError, match="2 token ids but 1 logprobs"):
        parse_samples_response(body(short), 1)
    with pytest.raises(InferenceError, match="malformed samples response"):
        parse_samples_response(b'{"choices": []}', 1)


def test_an_unknown_api_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="api='completions' is not one of 'auto', 'chat', 'samples'"):
        InferenceClient("http://127.0.0.1:1/v1", "tiny", api="completions")


def test_auto_takes_the_samples_route_only_for_one_server_without_routed_experts():
    """Several servers behind a router would all be sent to one; routed experts come back from chat only."""
    assert resolve_api("auto", [], routed_experts=False) == "samples"  # `rl`'s one server
    assert resolve_api("auto", ["http://127.0.0.1:8000"], routed_experts=False) == "samples"
    assert resolve_api("auto", ["http://127.0.0.1:8000", "http://127.0.0.1:8001"], routed_experts=False) == "chat"
    assert resolve_api("auto", [], routed_experts=True) == "chat"
    assert resolve_api("chat", [], routed_experts=False) == "chat" and resolve_api("samples", ["a", "b"], False)
    assert ClientConfig().api == "auto"  # what `rl` and the orchestrator run unless told otherwise


def test_auto_against_a_server_without_the_samples_route_uses_chat_for_the_rest_of_the_run(openai_server):
    """A plain OpenAI-compatible server (no /tokenize, no samples route): the first request falls back to the chat
    API, and every later one goes there directly."""

    async def go():
        client = InferenceClient(openai_server.base_url, "tiny", api="auto")
        try:
            assert client.api == "samples"
            first = await client.sample(MESSAGES, 3, SamplingArgs(max_tokens=16, temperature=0.7))
            second = await client.sample(MESSAGES, 3, SamplingArgs(max_tokens=16, temperature=0.7))
            return client.api, first, second
        finally:
            await client.aclose()

    api, first, second = asyncio.run(go())
    assert api == "chat"
    assert [c.text for c in first.completions] == [c.text for c in second.completions] == ["cba", "ba", "a"]
    # the refused /tokenize, then the two chat requests: nothing else was sent
    assert len(openai_server.requests) == 3 and "messages" in openai_server.requests[-1]


def test_samples_against_a_server_without_the_route_names_the_fix():
    """A plain vLLM server has /tokenize but not prime-rl's samples route: one error that says to use the chat API,
    not a bare 404 (and no retry)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class PlainVLLM(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            found = self.path == "/tokenize"
            data = json.dumps({"tokens": [5, 6, 7]} if found else {"detail": "Not Found"}).encode()
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), PlainVLLM)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    async def go():
        client = InferenceClient(f"http://127.0.0.1:{httpd.server_address[1]}/v1", "tiny", api="samples")
        try:
            await client.sample(MESSAGES, 2, SamplingArgs(max_tokens=4, temperature=1.0))
        finally:
            await client.aclose()

    try:
        with pytest.raises(InferenceError, match=r"HTTP 404.*no prime-rl samples route.*api = 'chat'"):
            asyncio.run(go())
    finally:
        httpd.shutdown()
        httpd.server_close()
