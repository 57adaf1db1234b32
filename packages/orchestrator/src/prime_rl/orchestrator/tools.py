"""Tools: OpenAI tool schemas, parsing the model's tool calls out of its sampled text, executing them.

Why the orchestrator parses tool calls itself (and not vLLM's `--tool-call-parser` on the chat API):
multi-turn rollouts send token ids to `/v1/completions` so that every later turn conditions on exactly
the sampled ids (see `multiturn.py`); that endpoint has no tool parsing. The parsers here are pure
Python and mirror vLLM's parser of the same name; `rl` takes `[inference.vllm] tool_call_parser` (what
chat-API users of the same deployment get) as the orchestrator's unless `orchestrator.model.tool_call_parser`
is set, and refuses the two set differently.

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

TOOL_CALL_PARSERS = ("hermes", "glm45")
"""Tool-call formats the orchestrator parses (vLLM parser names). Both wrap each call in <tool_call> tags:
hermes (Qwen, Hermes, most templates): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
glm45 (GLM-4.5 / 4.6 / 4.7): `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>`,
a string argument written raw, any other as JSON."""

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_CALL_OPEN = "<tool_call>"
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


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


def parse_tool_calls(
    text: str, parser: str = "hermes", call_id_prefix: str = "call", tools: list[dict[str, Any]] | None = None
) -> tuple[str, list[ToolCall]]:
    """Split sampled text into (content without the calls, calls). Malformed calls come back with `error` set.

    `tools` (the declared schemas) tells glm45 which arguments are strings, which it writes unquoted: "7"
    for a string parameter stays "7" (vLLM's glm45 parser does the same)."""
    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser={parser!r} is not supported; use one of {list(TOOL_CALL_PARSERS)}")
    calls: list[ToolCall] = []
    for i, match in enumerate(_CALL.finditer(text)):
        call_id = f"{call_id_prefix}_{i}"
        body = match.group(1)
        calls.append(
            _parse_hermes_call(body, call_id) if parser == "hermes" else _parse_glm45_call(body, call_id, tools)
        )
    content = _CALL.sub("", text)
    if _CALL_OPEN in content:  # an opened call that was never closed (e.g. cut by max_tokens)
        raw = content[content.index(_CALL_OPEN) :]
        calls.append(ToolCall(f"{call_id_prefix}_{len(calls)}", "", {}, raw, "unterminated <tool_call>"))
        content = content[: content.index(_CALL_OPEN)]
    return content.strip(), calls


def _string_params(tools: list[dict[str, Any]] | None, name: str) -> set[str]:
    for tool in tools or []:
        fn = tool.get("function", {})
        if fn.get("name") == name:
            props = fn.get("parameters", {}).get("properties", {})
            return {k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"}
    return set()


def _parse_glm45_call(body: str, call_id: str, tools: list[dict[str, Any]] | None) -> ToolCall:
    name, sep, rest = body.partition("<arg_key>")
    name = name.strip()
    if not _TOOL_NAME.fullmatch(name):
        return ToolCall(call_id, "", {}, body, f"tool call must start with the tool name, got {name[:40]!r}")
    pairs = _GLM_ARG.findall(sep + rest)
    if _GLM_ARG.sub("", sep + rest).strip():
        return ToolCall(call_id, name, {}, body, "arguments must be <arg_key>k</arg_key><arg_value>v</arg_value> pairs")
    strings = _string_params(tools, name)
    arguments: dict[str, Any] = {}
    for key, value in pairs:
        key = key.strip()
        if key in strings:
            arguments[key] = value
            continue
        try:
            arguments[key] = json.loads(value)
        except json.JSONDecodeError:
            arguments[key] = value  # an unquoted string where the schema is unknown
    return ToolCall(call_id, name, arguments, body)


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
