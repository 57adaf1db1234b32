"""The samples route: token ids in, token ids + sampled logprobs + text out, as arrays (``wire.SAMPLES_PATH``).

Why: the rollouts need each sampled token's id and logprob, and vLLM's chat API returns them as one pydantic
entry and ~93 bytes of JSON per token. On the H200 that made vLLM's server take 2.26x as long for the same 262k
tokens as the same generation without them (benchmarks/results/rollout_path.md): the API-server process, not the
GPU, bounded the rollouts. Here the engine is asked directly (``EngineClient.generate``) with vLLM's flat
logprobs (a few lists per request instead of a dict and a ``Logprob`` per token) and, unless stop strings need
the text as it grows, no detokenization per token (which also decodes each sampled token for its logprob
entry): each sample's text is decoded once at the end, as vLLM's detokenizer builds it (``TextDecoder``; the
tests compare it with the chat API's text). The answer carries the ids and logprobs as packed int32 / float32 bytes (``wire.Sample``).

Served as an ASGI middleware given to vLLM's ``--middleware`` (so the server module keeps no app code, as for
``http_auth``); it answers its one path and passes every other request on. It sits inside ``GuardEveryRoute``:
with an API key it needs the Bearer token like every other route. The engine and the served names come from the
app's state (``engine_client``, ``openai_serving_models``), which vLLM 0.26 and 0.32 both set.

Left to the chat API: tool definitions, multimodal input, routed experts (router replay), streaming. Behind a
vllm-router this path reaches one replica only (the router spreads the OpenAI and generate routes alone), so
``rl`` refuses the samples API with ``router.replicas > 1``.
"""

from __future__ import annotations

import array
import asyncio
import inspect
import json
import logging
import uuid
from typing import Any

import msgspec
from starlette.types import ASGIApp, Receive, Scope, Send

from prime_rl.common.wire import SAMPLES_PATH, SAMPLING_KNOBS, Sample, SamplesRequest, SamplesResponse

logger = logging.getLogger(__name__)
MIDDLEWARE = f"{__name__}.SamplesRoute"


class SamplesRoute:
    """ASGI middleware answering ``POST SAMPLES_PATH``; every other request goes on to vLLM's app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != SAMPLES_PATH:
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":
            await _reply(send, 405, {"error": f"{SAMPLES_PATH} takes POST, not {scope['method']}"})
            return
        body = await _read_body(receive)
        if body is None:
            return  # the client went away before it finished sending
        try:
            request = msgspec.json.decode(body, type=SamplesRequest)
        except msgspec.DecodeError as e:  # ValidationError is a DecodeError
            await _reply(send, 400, {"error": f"invalid {SAMPLES_PATH} body: {e}"})
            return
        state = scope["app"].state
        try:
            response = await _until_disconnect(receive, generate(state.engine_client, state, request))
        except SamplesRefused as e:
            await _reply(send, e.status, {"error": str(e)})
            return
        except _request_errors() as e:  # vLLM's own validation of the sampling parameters or the prompt
            await _reply(send, 400, {"error": f"{type(e).__name__}: {e}"})
            return
        except Exception as e:
            logger.exception("%s failed", SAMPLES_PATH)
            await _reply(send, 500, {"error": f"{type(e).__name__}: {e}"})
            return
        if response is not None:
            await _send(send, 200, msgspec.json.encode(response))


def _request_errors() -> tuple[type[Exception], ...]:
    """The exceptions that mean the request was wrong (400): vLLM's validation raises ``ValueError`` subclasses,
    and where it has a ``VLLMClientError`` (the class it maps to 4xx itself) that one, which is not a ValueError."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMClientError)


class SamplesRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def generate(engine: Any, state: Any, request: SamplesRequest) -> SamplesResponse:
    """``request.n`` samples of the prompt from ``engine`` (vLLM's ``EngineClient``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    lora = _lora_request(state, request.model)
    prompt = request.prompt_token_ids
    max_len = engine.model_config.max_model_len
    room = max_len - len(prompt)
    if room <= 0:  # "maximum context length": the phrase the orchestrator's client reads as a prompt too long
        raise SamplesRefused(
            400,
            f"This model's maximum context length is {max_len} tokens; the prompt has {len(prompt)}, which leaves "
            "no room to generate",
        )
    params = SamplingParams(
        n=request.n,
        max_tokens=min(request.max_tokens, room),
        **{k: getattr(request, k) for k in SAMPLING_KNOBS},
        stop=list(request.stop) or None,
        seed=request.seed,
        ignore_eos=request.ignore_eos,
        logprobs=0,  # the sampled token's only
        flat_logprobs=True,
        skip_special_tokens=False,
        # detokenizing token by token also decodes every sampled token for its logprob entry; without stop
        # strings (which vLLM checks in the text as it grows) each sample is decoded once at the end instead
        detokenize=bool(request.stop),
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    final = None
    request_id = f"prime-samples-{uuid.uuid4().hex}"
    async for output in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id, lora_request=lora):
        final = output
    if final is None:
        raise RuntimeError(f"vLLM returned no output for request {request_id}")
    prompt_ids = list(final.prompt_token_ids or prompt)
    decode = None if params.detokenize else TextDecoder(await _tokenizer(engine), prompt_ids)
    samples = [_sample(c, decode) for c in sorted(final.outputs, key=lambda c: c.index)]
    return SamplesResponse(prompt_token_ids=prompt_ids, samples=samples)


def _lora_request(state: Any, model: str) -> Any:
    models = state.openai_serving_models
    if models.is_base_model(model):
        return None
    lora = models.lora_requests.get(model)
    if lora is None:
        raise SamplesRefused(404, f"model {model!r} is not served here (neither the base model nor a loaded adapter)")
    return lora


async def _tokenizer(engine: Any) -> Any:
    tokenizer = engine.get_tokenizer()
    return await tokenizer if inspect.isawaitable(tokenizer) else tokenizer


def _sample(completion: Any, decode: TextDecoder | None) -> Sample:
    token_ids = list(completion.token_ids)
    return Sample(
        token_ids=array.array("i", token_ids).tobytes(),
        logprobs=array.array("f", sampled_logprobs(completion.logprobs, token_ids)).tobytes(),
        text=completion.text if decode is None else decode(completion),
        finish_reason=completion.finish_reason,
    )


class TextDecoder:
    """The text vLLM's detokenizer builds as it generates (a ``tokenizers`` ``DecodeStream`` primed with the
    prompt), from one decode at the end of each sample of one prompt:
    - decoded after the prompt and cut at the prompt's text (decoded once per request), so a first token's
      leading space survives as it does in the stream (SentencePiece decoders drop it at the start of a text);
    - without the token that stopped generation (an EOS or a stop token id), which vLLM leaves out;
    - without trailing tokens that decode to an incomplete character ("\ufffd" at the end), which the stream
      holds back until a later token completes them, so a sample cut by max_tokens mid-character ends earlier.
    Special tokens are kept (``skip_special_tokens = False``, as the chat request asks)."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int]) -> None:
        self.tokenizer, self.prompt_ids = tokenizer, prompt_ids
        self.head = tokenizer.decode(prompt_ids, skip_special_tokens=False)

    def __call__(self, completion: Any) -> str:
        token_ids = list(completion.token_ids)
        if completion.finish_reason == "stop" and not isinstance(completion.stop_reason, str) and token_ids:
            token_ids = token_ids[:-1]
        while True:
            text = self.tokenizer.decode(self.prompt_ids + token_ids, skip_special_tokens=False)
            if not (token_ids and text.endswith("\ufffd")):
                if text.startswith(self.head):
                    return text[len(self.head) :]
                return self.tokenizer.decode(token_ids, skip_special_tokens=False)
            token_ids = token_ids[:-1]


def sampled_logprobs(logprobs: Any, token_ids: list[int]) -> list[float]:
    """The sampled token's logprob at each position: vLLM's ``FlatLogprobs`` lists as they are when they hold
    exactly the sampled tokens (``logprobs=0``), else looked up position by position."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no logprobs although the request asked for them")
    flat = getattr(logprobs, "logprobs", None)
    if isinstance(flat, list) and len(flat) == len(token_ids) and logprobs.token_ids == token_ids:
        return flat
    return [position[token].logprob for token, position in zip(token_ids, logprobs, strict=True)]


async def _read_body(receive: Receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _until_disconnect(receive: Receive, work: Any) -> SamplesResponse | None:
    """``await work``, cancelled (which aborts the request in vLLM) if the client disconnects first: a rollout
    given up by the orchestrator must not keep generating."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _reply(send: Send, status: int, payload: dict) -> None:
    await _send(send, status, json.dumps(payload).encode())


async def _send(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
