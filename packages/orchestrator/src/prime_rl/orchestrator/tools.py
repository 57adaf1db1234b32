"""Tools: OpenAI tool schemas, parsing the model's tool calls out of its sampled text, executing them.

Why the orchestrator parses tool calls itself (and not vLLM's `--tool-call-parser` on the chat API):
multi-turn rollouts send token ids to `/v1/completions` so that every later turn conditions on exactly
the sampled ids (see `multiturn.py`); that endpoint has no tool parsing. The parsers here are pure
Python and mirror vLLM's parser of the same name, so `[inference.vllm] tool_call_parser = "hermes"`
(for chat-API users of the same deployment) and `orchestrator.model.tool_call_parser = "hermes"` agree.

A malformed call (bad JSON, no name, arguments not an object, unknown tool, a tool that raises) is the
model's mistake, not the run's: it comes back to the model as a tool message starting with "error:"
and is counted (`tool/malformed_calls`, `tool/failed_calls`); the rollout is scored as usual.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TOOL_CALL_PARSERS = ("hermes",)
"""Tool-call formats the orchestrator parses (vLLM parser names)."""

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"


@dataclass
class ToolCall:
    """One call the model made; `error` is set (and `name` / `arguments` may be empty) when it is malformed."""

    id: str
    name: str
    arguments: dict[str, Any]
    raw: str
    error: str | None = None

    def to_message(self) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry of the assistant message."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


def parse_tool_calls(text: str, parser: str = "hermes", call_id_prefix: str = "call") -> tuple[str, list[ToolCall]]:
    """Split sampled text into (content without the calls, calls). Malformed calls come back with `error` set."""
    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser={parser!r} is not supported; use one of {list(TOOL_CALL_PARSERS)}")
    calls: list[ToolCall] = []
    for i, match in enumerate(_HERMES.finditer(text)):
        calls.append(_parse_hermes_call(match.group(1), f"{call_id_prefix}_{i}"))
    content = _HERMES.sub("", text)
    if _HERMES_OPEN in content:  # an opened call that was never closed (e.g. cut by max_tokens)
        raw = content[content.index(_HERMES_OPEN) :]
        calls.append(ToolCall(f"{call_id_prefix}_{len(calls)}", "", {}, raw, "unterminated <tool_call>"))
        content = content[: content.index(_HERMES_OPEN)]
    return content.strip(), calls


def _parse_hermes_call(body: str, call_id: str) -> ToolCall:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(call_id, "", {}, body, f"tool call is not valid JSON ({e.msg} at char {e.pos})")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return ToolCall(call_id, "", {}, body, 'tool call must be a JSON object with a string "name"')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models double-encode the arguments
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(call_id, data["name"], {}, body, '"arguments" must be a JSON object')
    return ToolCall(call_id, data["name"], arguments, body)


_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


def function_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """An OpenAI tool schema from a plain function: name, first docstring line, typed parameters (all required
    unless they have a default)."""
    doc = inspect.getdoc(fn) or ""
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, param in inspect.signature(fn).parameters.items():
        annotation = param.annotation
        if isinstance(annotation, str):  # `from __future__ import annotations`
            annotation = {"int": int, "float": float, "str": str, "bool": bool, "list": list, "dict": dict}.get(
                annotation, str
            )
        properties[name] = {"type": _JSON_TYPES.get(annotation, "string")}
        if param.default is inspect.Parameter.empty:
            required.append(name)
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": doc.splitlines()[0] if doc else fn.__name__,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def validate_tool_schemas(tools: list[dict[str, Any]]) -> None:
    """Raise one clear ValueError for a schema vLLM (and the OpenAI API) would refuse."""
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f'tool {i} = {tool!r} must be {{"type": "function", "function": {{...}}}}')
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise ValueError(f"tool {i} has name {name!r}; a tool name must match [A-Za-z0-9_-]{{1,64}}")
        if name in names:
            raise ValueError(f"tool name {name!r} is declared twice; tool names must be unique")
        names.add(name)
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict) or params.get("type") != "object":
            raise ValueError(
                f'tool {name!r} has parameters {params!r}; they must be a JSON schema with "type": "object"'
            )


def execute_tool_call(call: ToolCall, tools: dict[str, Callable[..., Any]]) -> tuple[str, str | None]:
    """Run one call: (tool message content, error kind or None). Never raises: errors go back to the model."""
    if call.error is not None:
        return f"error: {call.error}", "malformed"
    fn = tools.get(call.name)
    if fn is None:
        return f"error: unknown tool {call.name!r}; available: {sorted(tools)}", "malformed"
    try:
        result = fn(**call.arguments)
    except TypeError as e:  # wrong / missing arguments
        return f"error: bad arguments for {call.name}: {e}", "malformed"
    except Exception as e:  # the tool itself failed on these arguments
        return f"error: {call.name} failed: {type(e).__name__}: {e}", "failed"
    return result if isinstance(result, str) else json.dumps(result), None
