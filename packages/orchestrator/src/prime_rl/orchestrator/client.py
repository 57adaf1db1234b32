"""Async client for the OpenAI-compatible chat API that vLLM serves, returning token ids + logprobs.

Why `/v1/chat/completions` (and not `/v1/completions` with a pre-tokenized prompt): the server applies
the model's own chat template and tokenizes, and with vLLM's `return_token_ids` it returns the exact
`prompt_token_ids` and each choice's `token_ids`, so the orchestrator needs no tokenizer at all.
Tokenizing here would mean `transformers` (which imports torch whenever torch is installed, and the
orchestrator must never import torch) or re-implementing chat templating over `tokenizers` + jinja.
Chat is also the API multi-turn and `verifiers` environments speak, and any OpenAI-compatible
deployment (router, load balancer) serves it.

Faults: connection errors, timeouts and 5xx answers are retried with exponential backoff
(`retry_backoff * 2**attempt`, capped by `max_backoff`); after `max_retries` retries the call raises
`InferenceUnreachableError` naming the URL. A 4xx is the request's fault and raises at once with
the server's message.

With a ``watch`` (`heal.InferenceWatch`: `rl` restarts inference, `inference.max_restarts`), a failure that
looks like the server going away (transport errors, 502/503/504) is not retried blindly: the watch holds
new requests until the server is back with the served policy, then the request is sent again. Inside a
``resent_by_caller()`` block (the rollout scheduler) it raises `InferenceLost` instead, so that the caller
sends its whole group again after the gate and tags it with the version that samples it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import io
import json
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import msgspec
import numpy as np

from prime_rl.common.config.orchestrator import ClientConfig, ClientModelConfig, SamplingConfig
from prime_rl.common.vllm_compat import ROUTED_EXPERTS_FIELD
from prime_rl.common.wire import SAMPLES_PATH, SAMPLING_KNOBS, SamplesRequest, SamplesResponse
from prime_rl.orchestrator.envs.base import Messages
from prime_rl.orchestrator.http_pool import ShardedHTTP
from prime_rl.orchestrator.responses import ChatResponse, ChatTokens, CompletionResponse
from prime_rl.orchestrator.rollout import Completion

if TYPE_CHECKING:
    from prime_rl.orchestrator.heal import InferenceWatch

logger = logging.getLogger(__name__)

_GONE_STATUSES = (502, 503, 504)
"""Answers of a server (or a router in front of it) that is going away or not back yet."""
T = TypeVar("T")
_RESENT_BY_CALLER: contextvars.ContextVar[bool] = contextvars.ContextVar("prime_rl_resent_by_caller", default=False)


@contextlib.contextmanager
def resent_by_caller() -> Iterator[None]:
    """In this block (this asyncio task), a request lost to an outage raises `InferenceLost`."""
    token = _RESENT_BY_CALLER.set(True)
    try:
        yield
    finally:
        _RESENT_BY_CALLER.reset(token)


_TOKEN_ID = re.compile(r"^token_id:(\d+)$")


class InferenceError(RuntimeError):
    """The inference server answered, but not with something usable."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """The HTTP status of a refused request (4xx), else None."""


class PromptTooLongError(InferenceError):
    """The server refused a prompt that alone does not fit its max_model_len (HTTP 400); the task is skipped."""


# vLLM's refusal (0.26 to 0.32, renderers/params.py) of a prompt longer than max_model_len allows
_CONTEXT_REFUSAL = "maximum context length"


class InferenceUnreachableError(InferenceError):
    """The inference server could not be reached (or kept failing) after all retries."""


class InferenceLost(InferenceUnreachableError):
    """The server went away during this request (e.g. it is being restarted): send it again once it is back."""


@dataclass
class ChatResult:
    prompt_ids: list[int]
    completions: list[Completion]


@dataclass
class TokenCompletion:
    """One choice of a token-id completion request: what the server conditioned on and what it sampled."""

    prompt_ids: list[int]
    """The prompt as the server echoed it back (the ground truth of what the sample conditioned on)."""
    completion: Completion


@dataclass(frozen=True)
class SamplingArgs:
    """Every sampling parameter vLLM would otherwise take from the model's generation_config.json."""

    max_tokens: int
    temperature: float
    chat_template: str | None = None
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    @classmethod
    def from_config(cls, sampling: SamplingConfig, chat_template: str | None = None) -> SamplingArgs:
        return cls(
            max_tokens=sampling.max_tokens,
            chat_template=chat_template,
            stop=tuple(sampling.stop),
            seed=sampling.seed,
            **{k: getattr(sampling, k) for k in SAMPLING_KNOBS},
        )


def resolve_api(api: str, metrics_urls: list[str], routed_experts: bool) -> str:
    """What "auto" means for a client (``ClientConfig.api``): the samples route when it talks to one server
    (several behind a router would all be sent to one) and no routed experts are asked for (only chat returns
    them); "chat" and "samples" stay as given."""
    if api != "auto":
        return api
    return "samples" if len(metrics_urls) <= 1 and not routed_experts else "chat"


def _config_default(name: str) -> Any:
    """``[model.client]``'s default for ``name`` (``ClientConfig``): a client built without a config (tests,
    tools) gets the settings a run gets, stated once. Read from the field, so no validator is built at import."""
    return ClientConfig.model_fields[name].default


class InferenceClient:
    """`await client.sample(messages, n, sampling)` -> prompt token ids + n completions."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str = _config_default("api_key"),
        timeout: float = _config_default("timeout"),
        max_retries: int = _config_default("max_retries"),
        retry_backoff: float = _config_default("retry_backoff"),
        max_backoff: float = _config_default("max_backoff"),
        max_connections: int = 1024,
        metrics_urls: list[str] | None = None,
        watch: InferenceWatch | None = None,
        api: str = "chat",
        routed_experts: bool = False,
    ) -> None:
        if api not in ("auto", "chat", "samples"):
            raise ValueError(f"api={api!r} is not one of 'auto', 'chat', 'samples' (orchestrator.model.client.api)")
        self.api = resolve_api(api, metrics_urls or [], routed_experts)
        """"chat": vLLM's chat completions; "samples": /tokenize, then prime-rl's samples route (``sample``)."""
        self.api_fallback = api == "auto" and self.api == "samples"
        """"auto" chose "samples": a server without the route (404) turns this client to "chat" for good."""
        self.base_url = base_url.rstrip("/")
        self.metrics_roots = [url.rstrip("/") for url in metrics_urls or []] or [self.server_root]
        """Servers whose /metrics rollout concurrency follows: each one behind a router, else this one."""
        self.url = f"{self.base_url}/chat/completions"
        self.model = model
        self.max_retries, self.retry_backoff, self.max_backoff = max_retries, retry_backoff, max_backoff
        self.watch = watch
        """Set by the orchestrator when inference may be restarted under it (see the module docstring)."""
        self.num_resent = 0
        """Requests this client sent again itself after an outage (not counting the scheduler's groups)."""
        self._http = ShardedHTTP(  # one httpx client's pool is quadratic in the requests in flight (http_pool.py)
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            headers={"Authorization": f"Bearer {api_key}"},
            max_connections=max_connections,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    @classmethod
    def from_config(cls, model: ClientModelConfig, routed_experts: bool = False) -> InferenceClient:
        """A client of `model.name` with the settings of its `[model.client]` table (``routed_experts``: the
        orchestrator asks for them, which only the chat API returns)."""
        c = model.client
        return cls(c.base_url, model.name, api_key=c.api_key, timeout=c.timeout, max_retries=c.max_retries,
                   retry_backoff=c.retry_backoff, max_backoff=c.max_backoff, metrics_urls=c.metrics_urls,
                   api=c.api, routed_experts=routed_experts)  # fmt: skip

    def build_request(self, messages: Messages, n: int, sampling: SamplingArgs) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "n": n,
            # All of them, always: a parameter left out is taken from generation_config.json.
            "max_tokens": sampling.max_tokens,
            **{k: getattr(sampling, k) for k in SAMPLING_KNOBS},
            "stop": list(sampling.stop),
            "seed": sampling.seed,
            "logprobs": True,
            "top_logprobs": 0,
            # vLLM extensions: token ids of prompt and completion, and tokens spelled "token_id:<id>"
            # (byte-level tokenizers otherwise come back as "" for partial UTF-8).
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if sampling.chat_template is not None:
            body["chat_template"] = sampling.chat_template
        return body

    async def sample(self, messages: Messages, n: int, sampling: SamplingArgs) -> ChatResult:
        if self.api == "samples":  # the same prompt ids the chat API would render, then the compact route
            try:
                prompt_ids = await self.tokenize_chat(messages, chat_template=sampling.chat_template)
                body = self.build_samples_request(prompt_ids, n, sampling)
                data = await self._post_raw(body, url=f"{self.server_root}{SAMPLES_PATH}")
            except InferenceError as e:
                if e.status != 404:
                    raise
                if self.api_fallback:  # "auto" against a server that is not prime-rl's: chat from now on
                    if self.api == "samples":  # the first of the requests in flight to be refused says so
                        logger.warning(f"{self.server_root} has no /tokenize or prime-rl samples route (HTTP 404): "
                                       "api 'auto' uses the chat API from now on")  # fmt: skip
                    self.api = "chat"
                    return await self.sample(messages, n, sampling)
                raise InferenceError(
                    f"{e}; this server has no prime-rl samples route: it is served by `inference` (prime-rl's vLLM "
                    "server) only; set orchestrator.model.client.api = 'chat' for any other server",
                    status=404,
                ) from None
            return parse_samples_response(data, n)
        return parse_chat_response(await self._post_raw(self.build_request(messages, n, sampling)), n)

    def build_samples_request(self, prompt_ids: list[int], n: int, sampling: SamplingArgs) -> dict[str, Any]:
        """The samples route's body (``wire.SamplesRequest``): every sampling parameter, as for the chat API."""
        body = self.build_request([], n, sampling)
        fields = set(SamplesRequest.__struct_fields__)
        return {**{k: v for k, v in body.items() if k in fields}, "prompt_token_ids": prompt_ids}

    # Token-level API (multi-turn rollouts, see multiturn.py): the server's own chat template renders
    # messages to ids (/tokenize), and generation takes ids in (/v1/completions with a token-id prompt).

    @property
    def server_root(self) -> str:
        """The server's root URL (vLLM serves /tokenize and /detokenize there, not under /v1)."""
        return self.base_url.removesuffix("/v1")

    async def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
    ) -> list[int]:
        """Token ids of `messages` rendered by the server's chat template (vLLM's /tokenize)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "add_special_tokens": False,
        }
        if tools:
            body["tools"] = tools
        if chat_template is not None:
            body["chat_template"] = chat_template
        data = await self._post(body, url=f"{self.server_root}/tokenize")
        return [int(t) for t in data["tokens"]]

    async def metrics_texts(self) -> list[str] | None:
        """Every server's Prometheus /metrics text (rollout concurrency follows their load), or None unless all
        answered: a sum over some of them would read as the load falling."""
        try:
            responses = await asyncio.gather(
                *(self._http.get(f"{root}/metrics", timeout=5.0) for root in self.metrics_roots)
            )
        except httpx.HTTPError:
            return None
        if any(response.status_code != 200 for response in responses):
            return None
        return [response.text for response in responses]

    async def detokenize(self, token_ids: list[int]) -> str:
        data = await self._post({"model": self.model, "tokens": token_ids}, url=f"{self.server_root}/detokenize")
        return data["prompt"]

    def build_completion_request(self, prompt_ids: list[int], n: int, sampling: SamplingArgs) -> dict[str, Any]:
        body = self.build_request([], n, sampling)
        del body["messages"], body["top_logprobs"]
        body.pop("chat_template", None)
        body.update(prompt=prompt_ids, logprobs=0, echo=False)
        return body

    async def complete(self, prompt_ids: list[int], n: int, sampling: SamplingArgs) -> list[TokenCompletion]:
        """Sample `n` continuations of exactly `prompt_ids` (vLLM's /v1/completions with a token-id prompt)."""
        data = await self._post_raw(
            self.build_completion_request(prompt_ids, n, sampling), url=f"{self.base_url}/completions"
        )
        return parse_completion_response(data, n)

    async def healthy(self) -> bool:
        """The server (or router) answers its HTTP health route."""
        try:
            response = await self._http.get(f"{self.server_root}/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _post(self, body: dict[str, Any], url: str | None = None) -> dict[str, Any]:
        return json.loads(await self._post_raw(body, url))

    async def _post_raw(self, body: dict[str, Any], url: str | None = None) -> bytes:
        """POST ``body`` as JSON (with the retries and outage handling of the module docstring); the answer's bytes."""
        url = url or self.url
        start = time.monotonic()
        last_error = ""
        attempt = resends = 0
        while True:
            gone = False
            try:
                response = await self._http.post(url, json=body)
            except httpx.TransportError as e:  # connect refused, DNS, timeouts, dropped connections
                last_error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                gone = True
            else:
                if response.status_code < 400:
                    return response.content
                if response.status_code < 500:
                    error = PromptTooLongError if _CONTEXT_REFUSAL in response.text else InferenceError
                    message = f"{url} refused the request with HTTP {response.status_code}: {response.text[:500]}"
                    raise error(message, status=response.status_code)
                last_error = f"HTTP {response.status_code}: {response.text[:200]}"
                gone = response.status_code in _GONE_STATUSES
            # bounded: a request the server keeps answering 503 while healthy must not loop forever
            if gone and self.watch is not None and resends <= self.max_retries:
                await self.watch.lost(f"{url}: {last_error}")
                if _RESENT_BY_CALLER.get():
                    raise InferenceLost(f"{url} went away during the request ({last_error})")
                await self.watch.wait()  # raises when it never came back
                self.num_resent += 1
                resends += 1
                continue
            if attempt == self.max_retries:
                break
            delay = min(self.max_backoff, self.retry_backoff * 2**attempt)
            logger.warning(
                "inference request to %s failed (%s); retry %d/%d in %.1fs",
                url, last_error, attempt + 1, self.max_retries, delay,
            )  # fmt: skip
            await asyncio.sleep(delay)
            attempt += 1
        raise InferenceUnreachableError(
            f"inference server at {url} unreachable after {self.max_retries + 1} attempts over "
            f"{time.monotonic() - start:.1f}s (last error: {last_error}); check that it is running and that "
            "orchestrator.model.client.base_url points at it"
        )


def _decode(data: bytes | dict[str, Any], schema: type[T], what: str) -> T:
    """A response body (raw JSON, or already decoded) as ``schema``; a body of the wrong shape is an InferenceError."""
    try:
        return msgspec.json.decode(data, type=schema) if isinstance(data, bytes) else msgspec.convert(data, schema)
    except msgspec.MsgspecError as e:
        raise InferenceError(f"unreadable {what} response: {e}; is the server vLLM (0.26 to 0.32)?") from None


def _spelled_token_ids(data: bytes | dict[str, Any]) -> dict[int, list[int]]:
    """Per choice index, the ids of tokens spelled "token_id:<id>" (the fallback when a server sends no token_ids)."""
    out = {}
    for choice in _decode(data, ChatTokens, "chat completion").choices or []:
        ids = []
        for entry in (choice.logprobs.content if choice.logprobs else None) or []:
            match = _TOKEN_ID.match(entry.token)
            if match is None:
                raise InferenceError(
                    "response has no choices[].token_ids and tokens are not 'token_id:<n>'; "
                    "serve with vLLM (return_token_ids / return_tokens_as_token_ids)"
                )
            ids.append(int(match.group(1)))
        out[choice.index] = ids
    return out


def decode_routed_experts(encoded: str | None, index: int = 0) -> np.ndarray | None:
    """A choice's routed experts (vLLM: base64 of the `.npy` bytes of a (tokens - 1, layers, top_k) uint8 / uint16
    array; see `vllm_compat.ROUTED_EXPERTS_FIELD`), or None when the server returned none."""
    if encoded is None:
        return None
    try:
        array = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    except ValueError as e:
        raise InferenceError(f"choice {index}: unreadable {ROUTED_EXPERTS_FIELD} ({e})") from None
    if array.ndim != 3:
        raise InferenceError(
            f"choice {index}: {ROUTED_EXPERTS_FIELD} has shape {array.shape}; expected (tokens - 1, layers, top_k)"
        )
    return array


def parse_chat_response(data: bytes | dict[str, Any], n: int) -> ChatResult:
    """Turn a chat-completions body (vLLM flavour; raw JSON or decoded) into prompt ids and completions."""
    body = _decode(data, ChatResponse, "chat completion")
    if body.prompt_token_ids is None:
        raise InferenceError("response has no prompt_token_ids; the server must support vLLM's return_token_ids=true")
    choices = sorted(body.choices or [], key=lambda c: c.index)
    if len(choices) != n:
        raise InferenceError(f"asked for n={n} completions, got {len(choices)}")
    spelled = _spelled_token_ids(data) if any(c.token_ids is None for c in choices) else {}
    completions = []
    for choice in choices:
        token_ids = choice.token_ids if choice.token_ids is not None else spelled.get(choice.index, [])
        content = (choice.logprobs.content if choice.logprobs else None) or []
        text = (choice.message.content if choice.message else None) or ""
        completion = Completion(token_ids, [entry.logprob for entry in content], text, choice.finish_reason)
        completion.routed_experts = decode_routed_experts(choice.routed_experts, choice.index)
        completions.append(completion)
    return ChatResult(body.prompt_token_ids, completions)


def parse_samples_response(data: bytes, n: int) -> ChatResult:
    """Turn the samples route's body (``wire.SamplesResponse``) into prompt ids and completions."""
    try:
        body = msgspec.json.decode(data, type=SamplesResponse)
    except msgspec.DecodeError as e:
        raise InferenceError(f"malformed samples response ({e}); is the server a prime-rl inference server?") from e
    if len(body.samples) != n:
        raise InferenceError(f"asked for n={n} samples, got {len(body.samples)}")
    completions = []
    for sample in body.samples:
        token_ids = np.frombuffer(sample.token_ids, dtype="<i4").tolist()
        logprobs = np.frombuffer(sample.logprobs, dtype="<f4").tolist()
        if len(logprobs) != len(token_ids):
            raise InferenceError(f"a sample has {len(token_ids)} token ids but {len(logprobs)} logprobs")
        completions.append(Completion(token_ids, logprobs, sample.text, sample.finish_reason))
    return ChatResult(body.prompt_token_ids, completions)


def parse_completion_response(data: bytes | dict[str, Any], n: int) -> list[TokenCompletion]:
    """Turn a /v1/completions body (vLLM flavour, `return_token_ids`, `logprobs=0`) into completions."""
    choices = sorted(_decode(data, CompletionResponse, "completion").choices or [], key=lambda c: c.index)
    if len(choices) != n:
        raise InferenceError(f"asked for n={n} completions, got {len(choices)}")
    out = []
    for choice in choices:
        if choice.token_ids is None or choice.prompt_token_ids is None:
            raise InferenceError(
                "completion choice has no token_ids / prompt_token_ids; the server must support vLLM's "
                "return_token_ids=true"
            )
        logprobs = (choice.logprobs.token_logprobs if choice.logprobs else None) or []
        completion = Completion(choice.token_ids, logprobs, choice.text or "", choice.finish_reason)
        out.append(TokenCompletion(choice.prompt_token_ids, completion))
    return out
