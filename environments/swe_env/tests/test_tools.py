"""The tools answer the model, never raise: a path outside the copy, a missing or ambiguous `old`, a protected
file name each come back as "error: ..." with what to do instead."""

from __future__ import annotations

import json

import pytest
from swe_env import SWEEnvironment

from prime_rl.orchestrator.envs.handle import dispatch

TASK = {"id": "pager-off-by-one"}


def ask(env: SWEEnvironment, name: str, messages: list | None = None, **arguments) -> str:
    """One tool call through the orchestrator's dispatch (a raw call dict, as a worker receives it)."""
    messages = list(messages or env.build_prompt(TASK))
    call = {"id": "call_9_0", "name": name, "arguments": arguments, "raw": json.dumps(arguments), "error": None}
    tool_call = {"id": call["id"], "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    messages.append({"role": "assistant", "content": "", "tool_calls": [tool_call]})
    (reply,) = dispatch(env, "env_response", {"task": TASK, "messages": messages, "calls": [call]})
    assert reply["role"] == "tool" and reply["tool_call_id"] == "call_9_0"
    return reply["content"]


def test_schemas_are_the_five_tools(env):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in env.tools}
    assert list(schemas) == ["list_files", "read_file", "replace_in_file", "write_file", "run_tests"]
    assert schemas["replace_in_file"]["required"] == ["path", "old", "new"]
    assert schemas["write_file"]["properties"] == {"path": {"type": "string"}, "content": {"type": "string"}}
    assert schemas["run_tests"] == {"type": "object", "properties": {}, "required": []}


def test_list_and_read(env):
    assert ask(env, "list_files").splitlines() == ["pager.py", "tests/test_pager.py"]  # no hidden tests
    assert "def paginate" in ask(env, "read_file", path="pager.py")
    assert "def paginate" in ask(env, "read_file", path="./tests/../pager.py")  # inside the copy: fine
    assert ask(env, "read_file", path="nope.py").startswith("error: 'nope.py' is not a file of the repository")
    assert ask(env, "read_file", path="tests").startswith("error: 'tests' is not a file")


@pytest.mark.parametrize(
    "path, message",
    [
        ("/etc/passwd", "is absolute"),
        ("~/.ssh/id_rsa", "is absolute"),
        ("../../../../etc/passwd", "leaves the repository"),
        ("tests/../../outside.py", "leaves the repository"),
        (".", "leaves the repository"),
        ("", "is empty"),
        ("a\x00b", "not a valid path"),
    ],
)
def test_paths_outside_the_copy_are_refused(env, tmp_path, path, message):
    for reply in (
        ask(env, "read_file", path=path),
        ask(env, "write_file", path=path, content="x"),
        ask(env, "replace_in_file", path=path, old="a", new="b"),
    ):
        assert reply.startswith("error:") and message in reply, reply
    assert not (tmp_path / "outside.py").exists()


def test_replace_in_file_needs_exactly_one_occurrence(env):
    reply = ask(env, "replace_in_file", path="pager.py", old="per_page", new="size")
    assert reply.startswith("error: `old` occurs") and "times in 'pager.py'; it must occur exactly once" in reply
    reply = ask(env, "replace_in_file", path="pager.py", old="start = page*per_page", new="x")
    assert reply.startswith("error: `old` does not occur in 'pager.py'") and "whitespace" in reply
    assert ask(env, "replace_in_file", path="pager.py", old="", new="x").startswith("error: `old` is empty")
    reply = ask(env, "replace_in_file", path="pager.py", old="start = page * per_page", new="start = 0")
    assert reply == "replaced 1 occurrence in pager.py"


def test_bad_arguments_and_protected_names_come_back_as_errors(env):
    assert ask(env, "read_file").startswith("error: bad arguments for read_file")  # `path` missing
    assert ask(env, "read_file", path=7).startswith("error: path 7 must be a string")
    for path in ("conftest.py", "tests/conftest.py", "pytest.ini", "tests/pyproject.toml", "pytest.py", "pluggy/x.py"):
        reply = ask(env, "write_file", path=path, content="")
        assert reply.startswith("error:") and "would configure or replace pytest" in reply, (path, reply)
    assert ask(env, "write_file", path="tests", content="").startswith("error: 'tests' is a directory")


def test_edits_persist_across_turns_and_output_is_bounded(workdir):
    env = SWEEnvironment(workdir=str(workdir), max_output_chars=300)
    messages = env.build_prompt(TASK)
    big = "\n".join(f"line {i}" for i in range(500))
    # the answered edit of an earlier turn is replayed into the next call's fresh copy
    turn = {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_0_0", "type": "function",
        "function": {"name": "write_file", "arguments": json.dumps({"path": "notes/big.txt", "content": big})},
    }]}  # fmt: skip
    messages += [turn, {"role": "tool", "tool_call_id": "call_0_0", "content": "wrote"}]
    assert "notes/big.txt" in ask(env, "list_files", messages)
    reply = ask(env, "read_file", messages, path="notes/big.txt")
    assert reply.startswith("line 0\nline 1") and "truncated: showing the first 300 of" in reply
    assert len(reply) < 400
    # a turn without a tool message after it was never executed: not replayed
    assert "notes/big.txt" not in ask(env, "list_files", [*messages[:-2], turn])
