"""Check a task file through the environment itself: each task's hidden tests fail on the repository as given,
and its `reference_patch` (driven through `replace_in_file`, as a model would) makes them and the visible
tests pass.

    python -m swe_env.check                      # the bundled tasks
    python -m swe_env.check my_tasks.jsonl --test-timeout 120

Exit code 1 when any task has a problem; one line per task either way.
"""

from __future__ import annotations

import argparse
import json
import sys

from prime_rl.orchestrator.envs.base import Messages, Task
from prime_rl.orchestrator.tools import ToolCall
from swe_env.env import SWEEnvironment
from swe_env.tasks import BUNDLED


def reference_conversation(env: SWEEnvironment, task: Task) -> Messages:
    """The prompt, one assistant turn calling `replace_in_file` for each edit of the reference patch, the
    environment's answers, and a closing reply: what a model that knew the fix would produce."""
    patch = env.task(task).get("reference_patch") or []
    calls = [ToolCall(f"call_0_{i}", "replace_in_file", dict(edit), raw="") for i, edit in enumerate(patch)]
    messages = env.build_prompt(task)
    messages.append({"role": "assistant", "content": "", "tool_calls": [c.to_message() for c in calls]})
    messages += env.env_response(task, messages, calls) or []
    messages.append({"role": "assistant", "content": "Fixed."})
    return messages


def check_task(env: SWEEnvironment, task: Task) -> list[str]:
    """What is wrong with one task (empty: sound)."""
    problems = []
    unfixed = env.test_report(task, env.build_prompt(task))
    if unfixed.all_passed:
        problems.append("its hidden tests pass on the repository as given: they do not detect the bug")
    if not env.task(task).get("reference_patch"):
        return [*problems, "no reference_patch: cannot check that the hidden tests can pass"]
    messages = reference_conversation(env, task)
    errors = [m["content"] for m in messages if m["role"] == "tool" and m["content"].startswith("error:")]
    if errors:
        problems.append(f"the reference patch does not apply: {errors[0]}")
    for hidden in (True, False):
        fixed = env.test_report(task, messages, hidden=hidden)
        suite = "hidden" if hidden else "visible"
        if (hidden or env.task(task)["visible_tests"]) and not fixed.all_passed:
            problems.append(
                f"its {suite} tests fail with the reference patch ({fixed.passed}/{fixed.total} passed):\n{fixed.output}"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swe_env.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("tasks", nargs="?", default=BUNDLED, help="a JSONL task file (default: the bundled tasks)")
    parser.add_argument("--test-timeout", type=float, default=60.0, help="seconds per pytest run")
    args = parser.parse_args(argv)
    env = SWEEnvironment(args.tasks, test_timeout=args.test_timeout)
    failed = 0
    for task_id in env.ids:
        problems = check_task(env, {"id": task_id})
        failed += bool(problems)
        print(f"{'FAIL' if problems else 'ok  '} {task_id}" + "".join(f"\n     - {p}" for p in problems))
    print(json.dumps({"tasks": len(env.ids), "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
