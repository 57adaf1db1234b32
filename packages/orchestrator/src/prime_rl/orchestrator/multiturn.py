"""Multi-turn rollouts with exact token accounting: the trainer sees exactly the ids that were sampled.

The silent failure this avoids: re-rendering a conversation through the chat template (or re-tokenizing
the sampled text) between turns gives token ids that differ from the ones sampled, so the trainer's
importance ratios compare logprobs of tokens the sampler never produced. Here nothing sampled is ever
re-tokenized:

- turn 1's prompt is the environment's messages rendered once by the server's chat template (`/tokenize`);
- every turn is sampled from a token-id prompt (`/v1/completions`), and its ids and logprobs are kept;
- the next prompt is `previous prompt + sampled ids + bridge + delta`, where `delta` is the template's
  rendering of only the environment's new messages (rendered after a fixed probe conversation and cut
  at the probe's end: the chat template's delta), and `bridge` is whatever the template writes after an
  assistant message's content that the model did not sample itself (ChatML: the "\\n" after <|im_end|>,
  or "<|im_end|>\\n" when the turn was cut by a stop string).

The training sample is the last prompt plus the last completion; the loss mask is True exactly on sampled
tokens (bridge and environment tokens are context). Each turn's prompt as the server echoed it back
(`prompt_token_ids`) is checked against that sample (`token_mismatches`, logged as
`rollout/token_mismatch`): non-zero would mean the trainer sees another context than the sampler did.

Start-up checks (`ChatRenderer.setup`) turn bad input into one line before any rollout: a template that
cannot close an assistant turn predictably, or cannot render tools and tool messages, and tool schemas
the server refuses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from prime_rl.orchestrator.client import InferenceClient, InferenceError, SamplingArgs, TokenCompletion
from prime_rl.orchestrator.envs.base import Messages, Task
from prime_rl.orchestrator.envs.handle import Budget, EnvFailure, EnvHandle
from prime_rl.orchestrator.rollout import Completion
from prime_rl.orchestrator.tools import ToolCall, parse_tool_calls, validate_tool_schemas

logger = logging.getLogger(__name__)

PROBE: Messages = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": "probe"}]
"""A fixed conversation that environment messages are rendered after, to cut out their delta."""

TOOL_PROBE_RESULT = "PROBE_TOOL_RESULT_7431"


class ChatTemplateError(ValueError):
    """The chat template cannot be used for token-exact multi-turn rollouts."""


class ChatRenderer:
    """Messages -> token ids through the server's chat template, and the delta of messages added later."""

    def __init__(
        self, client: InferenceClient, *, tools: list[dict[str, Any]] | None = None, chat_template: str | None = None
    ) -> None:
        self.client, self.tools, self.chat_template = client, tools or None, chat_template
        self.turn_tail: list[int] = []
        self._probe_ids: list[int] = []

    async def _render(self, messages: Messages, **kwargs: Any) -> list[int]:
        return await self.client.tokenize_chat(messages, tools=self.tools, chat_template=self.chat_template, **kwargs)

    async def setup(self) -> None:
        """Learn how the template closes an assistant turn; check that it renders tools. Raises one clear error."""
        if self.tools:
            validate_tool_schemas(self.tools)
        try:
            closed = await self._render(PROBE, add_generation_prompt=False)
            opened = await self._render(PROBE, add_generation_prompt=False, continue_final_message=True)
        except InferenceError as e:
            what = "the tool schemas or the chat template" if self.tools else "the chat template"
            raise ChatTemplateError(f"the inference server refused to render {what}: {e}") from e
        if closed[: len(opened)] != opened:
            raise ChatTemplateError(
                "the chat template renders an assistant message differently when it is closed than when it is "
                "continued, so the tokens after a sampled turn cannot be known; use a template that only appends "
                "an end-of-turn marker (e.g. ChatML) via orchestrator.model.chat_template"
            )
        self.turn_tail, self._probe_ids = closed[len(opened) :], closed
        await self.delta_ids([{"role": "user", "content": "probe"}])  # raises if earlier turns re-render
        if self.tools:
            await self._check_tools()

    async def _check_tools(self) -> None:
        name = self.tools[0]["function"]["name"]
        call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": "{}"}}
        conversation = [
            {"role": "user", "content": "probe"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": TOOL_PROBE_RESULT},
        ]
        try:
            text = await self.client.detokenize(await self._render(conversation, add_generation_prompt=True))
        except InferenceError as e:
            raise ChatTemplateError(f"the chat template cannot render a tool call and a tool message: {e}") from e
        if TOOL_PROBE_RESULT not in text:
            raise ChatTemplateError(
                "the chat template drops tool messages (a rendered tool result is missing from the prompt); "
                "set orchestrator.model.chat_template to a template with tool support"
            )
        if name not in text:
            raise ChatTemplateError(
                f"the chat template does not show the tools to the model (tool {name!r} is missing from the "
                "rendered prompt); set orchestrator.model.chat_template to a template with tool support"
            )

    async def prompt_ids(self, messages: Messages) -> list[int]:
        return await self._render(messages, add_generation_prompt=True)

    async def delta_ids(self, new_messages: Messages) -> list[int]:
        """Ids of `new_messages` (and the next generation prompt) as the template renders them after an assistant turn."""
        full = await self._render(PROBE + new_messages, add_generation_prompt=True)
        if full[: len(self._probe_ids)] != self._probe_ids:
            raise ChatTemplateError(
                "the chat template re-renders earlier messages once more follow, so new messages cannot be "
                "appended token-exactly; use a template that renders each message independently (e.g. ChatML)"
            )
        return full[len(self._probe_ids) :]

    def bridge(self, completion_ids: list[int]) -> list[int]:
        """The end-of-turn tokens the template writes after an assistant message that the model did not sample."""
        tail = self.turn_tail
        for k in range(min(len(tail), len(completion_ids)), 0, -1):
            if completion_ids[-k:] == tail[:k]:
                return tail[k:]
        return list(tail)


@dataclass
class Trajectory:
    """One multi-turn rollout: the first prompt, then every later token (sampled or not) with its mask."""

    prompt_ids: list[int]
    messages: Messages
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    """True on sampled tokens (trained on), False on bridge and environment tokens."""
    turns: list[TokenCompletion] = field(default_factory=list)
    finish_reason: str | None = None
    num_tool_calls: int = 0
    num_malformed_calls: int = 0
    error: str | None = None
    """Set when the environment raised while answering: the rollout scores 0 and counts as failed."""

    @property
    def context_ids(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def add_turn(self, turn: TokenCompletion) -> None:
        self.turns.append(turn)
        c = turn.completion
        self.token_ids += c.token_ids
        self.logprobs += c.logprobs
        self.mask += [True] * len(c.token_ids)

    def add_context(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [False] * len(ids)

    def token_mismatches(self) -> int:
        """Positions where the sample differs from what the server says it conditioned on and sampled."""
        ids, mismatches = self.context_ids, 0
        lp = [0.0] * len(self.prompt_ids) + self.logprobs
        mask = [False] * len(self.prompt_ids) + self.mask
        for turn in self.turns:
            p, c = turn.prompt_ids, turn.completion
            end = len(p) + len(c.token_ids)
            mismatches += max(0, end - len(ids))  # the sample is missing tokens the server saw
            mismatches += sum(a != b for a, b in zip(ids[: len(p)], p))
            for i, (t, logprob) in enumerate(zip(c.token_ids, c.logprobs), start=len(p)):
                if i < len(ids):
                    mismatches += ids[i] != t or not mask[i] or lp[i] != logprob
        return mismatches


async def run_rollout(
    client: InferenceClient,
    renderer: ChatRenderer,
    env: EnvHandle,
    task: Task,
    messages: Messages,
    sampling: SamplingArgs,
    *,
    max_len: int,
    prompt_ids: list[int] | None = None,
    budget: Budget | None = None,
) -> Trajectory:
    """Sample turns until the environment stops, `max_turns` turns, or the sequence reaches `max_len`.
    The environment's replies share `budget` (its time for this rollout); a failed reply ends the rollout
    with `error` set (scored 0, counted)."""
    info = env.info
    messages = [dict(m) for m in messages]
    if prompt_ids is None:
        prompt_ids = await renderer.prompt_ids(messages)
    traj = Trajectory(prompt_ids=list(prompt_ids), messages=messages)
    for turn in range(info.max_turns):
        room = max_len - len(traj.context_ids)
        if room <= 0:
            traj.finish_reason = "length"
            break
        args = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, room))
        (sampled,) = await client.complete(traj.context_ids, 1, args)
        completion = sampled.completion
        traj.finish_reason = completion.finish_reason
        if completion.finish_reason == "abort":
            break
        traj.add_turn(sampled)
        calls: list[ToolCall] = []
        content = completion.text
        if info.tools:
            content, calls = parse_tool_calls(
                completion.text, info.tool_call_parser, call_id_prefix=f"call_{turn}", tools=info.tools
            )
            tool_names = {t["function"]["name"] for t in info.tools}
            traj.num_tool_calls += len(calls)
            traj.num_malformed_calls += sum(c.error is not None or c.name not in tool_names for c in calls)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if any(c.error is None for c in calls):
            message["tool_calls"] = [c.to_message() for c in calls if c.error is None]
        messages.append(message)
        # A turn cut by the per-turn max_tokens goes on (the bridge closes it with the template's end-of-turn
        # tokens); one cut because the sequence is full ends the rollout.
        if (completion.finish_reason == "length" and args.max_tokens < sampling.max_tokens) or (
            turn == info.max_turns - 1
        ):
            break
        try:  # in a worker process or a thread, with a deadline (envs/handle.py)
            new = await env.env_response(task, messages, calls, budget)
        except EnvFailure as e:
            logger.warning("%s", e)
            traj.error = str(e)
            break
        if not new:
            break
        messages.extend(new)
        traj.add_context(renderer.bridge(completion.token_ids) + await renderer.delta_ids(new))
    while traj.mask and not traj.mask[-1]:  # context no turn was sampled after teaches nothing
        traj.token_ids.pop(), traj.logprobs.pop(), traj.mask.pop()
    return traj


@dataclass
class MultiTurnGroup:
    prompt_ids: list[int]
    completions: list[Completion]
    trajectories: list[Trajectory]


def to_completion(traj: Trajectory) -> Completion:
    last = next((m for m in reversed(traj.messages) if m["role"] == "assistant"), {})
    stats = {
        "rollout/turns": float(len(traj.turns)),
        "rollout/token_mismatch": float(traj.token_mismatches()),
        "tool/calls": float(traj.num_tool_calls),
        "tool/malformed_calls": float(traj.num_malformed_calls),
        "env/response_failed": float(traj.error is not None),
    }
    return Completion(
        list(traj.token_ids), list(traj.logprobs), last.get("content") or "", traj.finish_reason, list(traj.mask), stats
    )


async def sample_group(
    client: InferenceClient,
    renderer: ChatRenderer,
    env: EnvHandle,
    task: Task,
    messages: Messages,
    n: int,
    sampling: SamplingArgs,
    *,
    max_len: int,
    budgets: list[Budget] | None = None,
) -> MultiTurnGroup:
    """`n` independent multi-turn rollouts of one task (the shared prompt is rendered once; vLLM's prefix
    cache shares its KV). Sample i uses seed `sampling.seed + i` like a chat request with `n` would."""
    prompt_ids = await renderer.prompt_ids(messages)

    def args(i: int) -> SamplingArgs:
        return sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + i)

    budgets = budgets or [Budget(env.timeout) for _ in range(n)]
    trajectories = await asyncio.gather(
        *(
            run_rollout(
                client, renderer, env, task, messages, args(i), max_len=max_len, prompt_ids=prompt_ids,
                budget=budgets[i],
            )
            for i in range(n)
        )
    )  # fmt: skip
    return MultiTurnGroup(prompt_ids, [to_completion(t) for t in trajectories], list(trajectories))
