"""Whole rollouts through the orchestrator's own call path: the model's text parsed into tool calls, the
environment answering through an EnvHandle (in threads, or in worker processes loaded from the TOML's
entrypoint), then scored: a right fix earns 1, a wrong one 0, and a fix that hangs is killed and earns 0."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
from swe_env import SWEEnvironment

from prime_rl.orchestrator.envs.handle import EnvHandle, LocalEnv
from prime_rl.orchestrator.envs.worker import WorkerEnv
from prime_rl.orchestrator.tools import parse_tool_calls

TASK = {"id": "pager-off-by-one"}
BUG, FIX = "start = page * per_page", "start = (page - 1) * per_page"


def hermes(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def glm45(name: str, **arguments) -> str:
    args = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in arguments.items())
    return f"<tool_call>{name}{args}</tool_call>"


async def play(handle: EnvHandle, task: dict, turns: list[str], parser: str = "hermes") -> tuple[list, float]:
    """A scripted policy: each turn's text goes through what `multiturn.run_rollout` does with a sampled turn
    (parse the calls, append the assistant message, ask the environment); then the rollout is scored."""
    messages = await handle.build_prompt(task)
    info = handle.info
    for turn, text in enumerate(turns):
        content, calls = parse_tool_calls(text, parser, call_id_prefix=f"call_{turn}", tools=info.tools)
        message = {"role": "assistant", "content": content}
        if any(c.error is None for c in calls):
            message["tool_calls"] = [c.to_message() for c in calls if c.error is None]
        messages.append(message)
        if turn == info.max_turns - 1:
            break
        reply = await handle.env_response(task, messages, calls)
        if not reply:
            break
        messages.extend(reply)
    score = await handle.score(task, messages[-1]["content"], messages)
    assert not score.failed, score.error
    return messages, score.reward


def tool_replies(messages: list) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "tool"]


@pytest.mark.parametrize("fmt, parser", [(hermes, "hermes"), (glm45, "glm45")])
def test_scripted_fix_earns_1(env, fmt, parser):
    turns = [
        fmt("read_file", path="pager.py") + fmt("run_tests"),
        fmt("replace_in_file", path="pager.py", old=BUG, new=FIX),
        fmt("run_tests"),
        "Fixed: pages are numbered from 1, so page p starts at (p - 1) * per_page.",
    ]
    messages, reward = asyncio.run(play(LocalEnv(env), TASK, turns, parser))
    read, tests_before, replaced, tests_after = tool_replies(messages)
    assert BUG in read and "1 failed, 1 passed" in tests_before and "[pytest exit code 1]" in tests_before
    assert replaced == "replaced 1 occurrence in pager.py"
    assert "2 passed" in tests_after and "[pytest exit code 0]" in tests_after
    assert reward == 1.0


def test_wrong_edit_earns_0_and_an_unanswered_last_turn_is_not_scored(env):
    # The visible tests pass (page 1 is right), the hidden ones do not (page 2 is wrong): reward 0.
    wrong = [hermes("replace_in_file", path="pager.py", old=BUG, new="start = 0 if page == 1 else page"), "done"]
    messages, reward = asyncio.run(play(LocalEnv(env), TASK, wrong))
    assert tool_replies(messages) == ["replaced 1 occurrence in pager.py"] and reward == 0.0
    assert env.test_report(TASK, messages, hidden=False).all_passed
    report = env.test_report(TASK, messages)
    assert 0 < report.passed < report.total
    # The right fix, written in the turn cut by max_turns, was never executed: the repository is unfixed.
    short = SWEEnvironment(max_turns=2, workdir=env.workdir)
    turns = [hermes("list_files"), hermes("replace_in_file", path="pager.py", old=BUG, new=FIX)]
    messages, reward = asyncio.run(play(LocalEnv(short), TASK, turns))
    assert len(tool_replies(messages)) == 1 and reward == 0.0


def test_errors_go_back_to_the_model_and_the_rollout_goes_on(env):
    turns = [
        hermes("read_file", path="../../etc/passwd")
        + hermes("replace_in_file", path="pager.py", old="per_page", new="n"),
        "<tool_call>{not json</tool_call>" + hermes("no_such_tool"),
        hermes("replace_in_file", path="pager.py", old=BUG, new=FIX),
        "done",
    ]
    messages, reward = asyncio.run(play(LocalEnv(env), TASK, turns))
    escape, ambiguous, malformed, unknown, fixed = tool_replies(messages)
    assert escape.startswith("error: path '../../etc/passwd' leaves the repository")
    assert ambiguous.startswith("error: `old` occurs")
    assert malformed.startswith("error: tool call is not valid JSON") and unknown.startswith("error: unknown tool")
    assert fixed == "replaced 1 occurrence in pager.py" and reward == 1.0


HANGING_PAGER = """
import subprocess

SLEEPER = subprocess.Popen(["sleep", "300"])  # a child of the test run: must die with it
with open({pid_file!r}, "w") as f:
    f.write(str(SLEEPER.pid))


def num_pages(items, per_page):
    return (len(items) + per_page - 1) // per_page


def paginate(items, page, per_page):
    while True:
        pass
"""


def test_a_hanging_fix_is_killed_at_the_timeout_with_its_children_and_scores_0(workdir, tmp_path, gone):
    timeout = 8.0  # room for pytest to start on a loaded 2-core machine before the hang begins
    env = SWEEnvironment(workdir=str(workdir), test_timeout=timeout)
    pid_file = tmp_path / "sleeper.pid"
    code = HANGING_PAGER.format(pid_file=str(pid_file))
    turns = [hermes("write_file", path="pager.py", content=code), "done"]
    start = time.monotonic()
    messages, reward = asyncio.run(play(LocalEnv(env), TASK, turns))
    elapsed = time.monotonic() - start
    assert reward == 0.0
    assert timeout <= elapsed < timeout + 20
    assert gone(int(pid_file.read_text())), "the tests' child process survived the kill of their process group"


def test_run_tests_that_hang_answer_the_model_after_the_timeout(workdir):
    env = SWEEnvironment(workdir=str(workdir), test_timeout=2.0)
    loop = "def paginate(items, page, per_page):\n    while True:\n        pass\n\n\ndef num_pages(items, n):\n    return 0\n"
    turns = [hermes("write_file", path="pager.py", content=loop), hermes("run_tests"), "done"]
    start = time.monotonic()
    messages, reward = asyncio.run(play(LocalEnv(env), TASK, turns))
    assert time.monotonic() - start < 2 * 2.0 + 20 and reward == 0.0
    assert tool_replies(messages)[1].endswith("[killed: the tests ran longer than the 2s timeout]\n[pytest timed out]")


def test_infinite_output_is_bounded(workdir):
    env = SWEEnvironment(workdir=str(workdir), test_timeout=3.0, max_output_chars=1000)
    spam = "import time\n\n\ndef paginate(items, page, per_page):\n    while True:\n        print('x' * 1000)\n"
    spam += "        time.sleep(0.001)\n\n\n"
    spam += "def num_pages(items, n):\n    return 0\n"
    test = "from pager import paginate\n\n\ndef test_spam(capsys):\n    with capsys.disabled():\n        paginate([], 1, 1)\n"
    turns = [
        hermes("write_file", path="pager.py", content=spam),
        hermes("write_file", path="tests/test_pager.py", content=test),
    ]
    messages, _ = asyncio.run(play(LocalEnv(env), TASK, [*turns, hermes("run_tests"), "done"]))
    out = tool_replies(messages)[-1]
    assert "bytes of output cut" in out and "timed out" in out and len(out) < 1300


def test_entrypoint_in_worker_processes_two_concurrent_rollouts(workdir):
    """As `[[orchestrator.env]] type = "python", entrypoint = "swe_env:SWEEnvironment"` runs it: worker
    processes built from the config, arguments through `kwargs`, calls and results over ZeroMQ."""
    config = {
        "type": "python",
        "entrypoint": "swe_env:SWEEnvironment",
        "kwargs": {"tasks": "bundled", "test_timeout": 60, "workdir": str(workdir)},
    }

    async def go() -> tuple[float, float]:
        handle = WorkerEnv(config, "swe", timeout=300.0, num_workers=2)
        await handle.start()
        try:
            assert handle.info.multi_turn and len(handle.info.tools) == 5
            fix = [
                hermes("read_file", path="pager.py"),
                hermes("replace_in_file", path="pager.py", old=BUG, new=FIX),
                "ok",
            ]
            wrong = [hermes("write_file", path="pager.py", content="def paginate(*a):\n    return []\n"), "ok"]
            (_, right), (_, bad) = await asyncio.gather(play(handle, TASK, fix), play(handle, TASK, wrong))
            assert not handle.pop_counters()  # no timeouts, crashes or failures
            return right, bad
        finally:
            await handle.close()

    assert asyncio.run(go()) == (1.0, 0.0)
    assert os.listdir(workdir) == []
