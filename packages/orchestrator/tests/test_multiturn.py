"""Multi-turn bookkeeping without a server: tool-call parsing, the end-of-turn bridge, the token-mismatch
check, and packing with a loss mask (the vLLM-backed proof is tests/test_multiturn_vllm.py)."""

from __future__ import annotations

import numpy as np

from prime_rl.orchestrator.client import TokenCompletion
from prime_rl.orchestrator.envs.tool_arithmetic import ToolArithmeticEnv
from prime_rl.orchestrator.multiturn import ChatRenderer, Trajectory
from prime_rl.orchestrator.packing import pack_batch
from prime_rl.orchestrator.rollout import Completion, Sample
from prime_rl.orchestrator.tools import execute_tool_call, function_schema, parse_tool_calls


def test_parse_tool_calls_valid_malformed_and_unterminated():
    text = 'ok <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><tool_call>{bad</tool_call>'
    content, calls = parse_tool_calls(text + "<tool_call>{")
    assert content == "ok"
    assert [c.name for c in calls] == ["add", "", ""]
    assert calls[0].arguments == {"a": 1, "b": 2} and calls[0].error is None
    assert "not valid JSON" in calls[1].error and "unterminated" in calls[2].error
    fns = {"add": lambda a, b: a + b}
    assert execute_tool_call(calls[0], fns) == ("3", None)
    assert execute_tool_call(calls[1], fns)[1] == "malformed"
    _, (unknown,) = parse_tool_calls('<tool_call>{"name": "sub", "arguments": {}}</tool_call>')
    assert execute_tool_call(unknown, fns)[0].startswith("error: unknown tool 'sub'")
    _, (wrong_args,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>')
    assert execute_tool_call(wrong_args, fns)[1] == "malformed"


def test_parse_glm45_tool_calls():
    """GLM-4.5's format: the name, then key/value pairs; strings raw (by the declared schema), the rest JSON."""

    def search(query: str, limit: int) -> str:
        """Search."""
        return query

    tools = [function_schema(search)]
    text = (
        "Looking.\n<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>42</arg_value>\n"
        "<arg_key>limit</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
        "<tool_call>search<arg_key>query</arg_key><arg_value>a b</arg_value>stray</tool_call>"
        '<tool_call>{"name": "search"}</tool_call><tool_call>search<arg_key>query'
    )
    content, calls = parse_tool_calls(text, "glm45", tools=tools)
    assert content == "Looking."
    assert calls[0].name == "search" and calls[0].arguments == {"query": "42", "limit": 3} and calls[0].error is None
    assert execute_tool_call(calls[0], {"search": search}) == ("42", None)
    assert "pairs" in calls[1].error  # text between the pairs
    assert "start with the tool name" in calls[2].error  # a hermes call is not a glm45 call
    assert "unterminated" in calls[3].error
    _, (untyped,) = parse_tool_calls(
        "<tool_call>f<arg_key>x</arg_key><arg_value>[1, 2]</arg_value></tool_call>", "glm45"
    )
    assert untyped.arguments == {"x": [1, 2]}  # no schema: JSON where it parses


def test_function_schema_and_tool_env_scoring():
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    schema = function_schema(add)["function"]
    assert schema["name"] == "add" and schema["parameters"]["required"] == ["a", "b"]
    assert schema["parameters"]["properties"]["a"] == {"type": "integer"}
    env = ToolArithmeticEnv(max_value=9)
    task = {"op": "add", "a": 3, "b": 4, "answer": 7}
    _, calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>')
    messages = env.build_prompt(task) + [{"role": "assistant", "content": "", "tool_calls": [calls[0].to_message()]}]
    reply = env.env_response(task, messages, calls)
    assert reply == [{"role": "tool", "tool_call_id": "call_0", "content": "7"}]
    assert env.env_response(task, messages, []) is None  # no call: the answer, rollout over
    done = messages + reply + [{"role": "assistant", "content": "7"}]
    assert env.score_rollout(task, done) == 1.0
    assert env.score_rollout(task, messages + reply + [{"role": "assistant", "content": "8"}]) == 0.5
    _, bad = parse_tool_calls("<tool_call>{oops</tool_call>")
    assert env.env_response(task, messages, bad)[0]["content"].startswith("error:")
    assert env.score_rollout(task, env.build_prompt(task) + [{"role": "assistant", "content": "7"}]) == 0.5


def test_bridge_closes_a_turn_with_what_the_model_did_not_sample():
    renderer = ChatRenderer(client=None)  # type: ignore[arg-type]
    renderer.turn_tail = [2, 10]  # ChatML: <|im_end|> "\n"
    assert renderer.bridge([5, 6, 2]) == [10]  # stopped on EOS: only the newline
    assert renderer.bridge([5, 6]) == [2, 10]  # cut by max_tokens: the whole end of turn
    assert renderer.bridge([2, 10]) == []


def _turn(prompt: list[int], ids: list[int], lps: list[float]) -> TokenCompletion:
    return TokenCompletion(prompt, Completion(ids, lps, "x", "stop"))


def test_token_mismatches_counts_any_difference_from_what_the_server_saw():
    traj = Trajectory(prompt_ids=[1, 2], messages=[])
    traj.add_turn(_turn([1, 2], [3, 4], [-0.1, -0.2]))
    traj.add_context([9, 9])
    traj.add_turn(_turn([1, 2, 3, 4, 9, 9], [5], [-0.3]))
    assert traj.context_ids == [1, 2, 3, 4, 9, 9, 5]
    assert traj.mask == [True, True, False, False, True]
    assert traj.token_mismatches() == 0
    # what a re-tokenizing implementation gets wrong: the server's context differs from the sample
    traj.turns[1] = _turn([1, 2, 3, 7, 9, 9], [5], [-0.3])
    assert traj.token_mismatches() == 1
    traj.turns[1] = _turn([1, 2, 3, 4, 9, 9], [5], [-0.4])  # a logprob that is not the sampled one
    assert traj.token_mismatches() == 1


def test_packing_trains_only_on_sampled_tokens():
    sample = Sample([1, 2], [3, 4, 9, 9, 5], [-0.1, -0.2, 0.0, 0.0, -0.3], 0.5, 1.0, None,
                    [True, True, False, False, True])  # fmt: skip
    (mbs,), _ = pack_batch([sample], seq_len=16, num_ranks=1)
    mb = mbs[0]
    assert mb.loss_mask[:7].tolist() == [False, False, True, True, False, False, True]
    np.testing.assert_array_equal(mb.advantages[:7], np.float32([0, 0, 0.5, 0.5, 0, 0, 0.5]))
    assert mb.num_loss_tokens == 3
