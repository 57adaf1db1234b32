"""The parts of vLLM's JSON answers that the orchestrator reads, as msgspec Structs (decoded by client.py).

Why typed decoding: a chat completion with logprobs carries one object per sampled token (its "token_id:<id>"
spelling, logprob, UTF-8 bytes and top logprobs), about 1 MB for 8 x 1,024 tokens. `json.loads` built every
one of those objects as a dict, then Python loops picked the ids and floats out: 45 ms a response on the 2-core
development machine, ~1.5 s for a 256-rollout step, all of it after the last token because a synchronous
step's groups finish together (benchmarks/rollout_path.py, BENCHMARKS.md). Decoding straight into these
Structs builds only the ids, floats and text we keep and skips the rest in C: 2.3 ms.

Every field has a default: what a field's absence means (an error, a fallback) is decided in client.py, where it
was decided before. Unknown fields are ignored, so newer vLLM versions' additions cost nothing.
"""

from __future__ import annotations

import msgspec

from prime_rl.common.vllm_compat import ROUTED_EXPERTS_FIELD


class Message(msgspec.Struct):
    content: str | None = None


class LogprobEntry(msgspec.Struct):
    logprob: float


class ChatLogprobs(msgspec.Struct):
    content: list[LogprobEntry] | None = None


class _Choice(msgspec.Struct):
    """What the orchestrator reads of a choice from either API: its place in ``n``, why it stopped and its
    token ids (vLLM's ``return_token_ids``)."""

    index: int = 0
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatChoice(_Choice):
    message: Message | None = None
    logprobs: ChatLogprobs | None = None
    routed_experts: str | None = msgspec.field(default=None, name=ROUTED_EXPERTS_FIELD)


class ChatResponse(msgspec.Struct):
    choices: list[ChatChoice] | None = None
    prompt_token_ids: list[int] | None = None


class TokenEntry(msgspec.Struct):
    token: str = ""


class TokenLogprobs(msgspec.Struct):
    content: list[TokenEntry] | None = None


class TokenChoice(msgspec.Struct):
    index: int = 0
    logprobs: TokenLogprobs | None = None


class ChatTokens(msgspec.Struct):
    """The token spellings alone: read only from a server that returned no `token_ids` (the fallback)."""

    choices: list[TokenChoice] | None = None


class CompletionLogprobs(msgspec.Struct):
    token_logprobs: list[float] | None = None


class CompletionChoice(_Choice):
    text: str | None = None
    logprobs: CompletionLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(msgspec.Struct):
    choices: list[CompletionChoice] | None = None
