"""A multi-turn environment whose turns are tool calls: it executes each call and answers with tool messages.

The rollout ends when the model replies without a tool call (its answer) or after `max_turns` turns.
Tools are plain Python functions; their OpenAI schemas come from their signatures (`tools.function_schema`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prime_rl.orchestrator.envs.base import Messages, MultiTurnEnvironment, Task
from prime_rl.orchestrator.tools import ToolCall, execute_tool_call, function_schema, validate_tool_schemas


class ToolEnvironment(MultiTurnEnvironment):
    def __init__(self, functions: list[Callable[..., Any]], max_turns: int = 4, tool_call_parser: str = "hermes"):
        if max_turns < 2:
            raise ValueError(f"max_turns={max_turns}: a tool environment needs >= 2 turns (call, then answer)")
        self.functions = {fn.__name__: fn for fn in functions}
        self.tools = [function_schema(fn) for fn in functions]
        validate_tool_schemas(self.tools)
        self.max_turns, self.tool_call_parser = max_turns, tool_call_parser

    def env_response(self, task: Task, messages: Messages, calls: list[ToolCall]) -> Messages | None:
        if not calls:
            return None  # no call: that was the answer
        return [
            {"role": "tool", "tool_call_id": call.id, "content": execute_tool_call(call, self.functions)[0]}
            for call in calls
        ]
