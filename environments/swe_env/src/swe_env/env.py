"""SWEEnvironment: fix a bug in a small Python repository with file tools and the visible tests; hidden tests score it.

Design decisions:

- **Stateless across calls: the copy is rebuilt from the conversation.** The orchestrator sends each call
  of a rollout (prompt, each reply, score) to whichever worker process has the fewest in flight, and kills
  and replaces a worker that overruns, so no worker can keep a rollout's directory between calls. What
  every call does get is the task and the conversation so far. So each call copies the task's repository
  into a fresh temp dir, replays the edits (`replace_in_file`, `write_file`) of every earlier assistant turn
  that the environment answered, in order, runs the new calls, and removes the dir. Edits are deterministic
  and cheap (a few small files); `read_file`, `list_files` and `run_tests` are not replayed. What is lost:
  files a test run wrote into the copy do not survive into the next turn.
- **Hidden tests exist only while scoring.** They are written into the scoring copy after the model's edits
  (over any file of the same path) and never appear in a tool answer, so the model cannot read or tailor
  them. Reward 1.0 when every hidden test passes (counted from pytest's JUnit report, not its exit code),
  else 0.0; `test_report` gives passed / total for offline use. The orchestrator has no per-rollout metric
  channel from an environment (a score is reward, failed, error), so the passed fraction is not logged.
- **Tasks travel as ids.** `sample_tasks` returns `{"id": ...}`; the repository, tests and statement are
  looked up in the task file loaded at build time, so a call's message stays small and hidden tests never
  leave the environment process.
- The rollout ends when the model replies without a tool call (its "done") or after `max_turns` turns.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from prime_rl.orchestrator.envs.base import Messages, Task
from prime_rl.orchestrator.envs.tool_env import ToolEnvironment
from prime_rl.orchestrator.tools import ToolCall, execute_tool_call
from swe_env.runner import PytestRun
from swe_env.tasks import BUNDLED, load_tasks
from swe_env.workspace import EDIT_TOOLS, Workspace

INSTRUCTIONS = (
    "You are working in a Python repository with a bug. Use the tools to read the files, edit them and run "
    "the visible tests. When you have fixed the bug, reply with a short summary and no tool call: that ends "
    "the episode, and hidden tests of the described behaviour decide whether the fix is right."
)


class SWEEnvironment(ToolEnvironment):
    name = "swe"

    def __init__(
        self,
        tasks: str = BUNDLED,
        max_turns: int = 16,
        test_timeout: float = 60.0,
        max_output_chars: int = 8000,
        workdir: str | None = None,
    ) -> None:
        """`tasks`: a JSONL task file, or "bundled"; `max_turns`: assistant turns per rollout; `test_timeout`:
        seconds one pytest run may take before its process group is killed; `max_output_chars`: bound on a
        tool answer (test output, a file's text); `workdir`: where the per-call copies go (default: TMPDIR)."""
        if test_timeout <= 0:
            raise ValueError(f"swe_env test_timeout={test_timeout} must be > 0 seconds; e.g. 60")
        if max_output_chars < 200:
            raise ValueError(f"swe_env max_output_chars={max_output_chars} must be >= 200 to show a test failure")
        if workdir is not None and not Path(workdir).is_dir():
            raise ValueError(f"swe_env workdir={workdir!r} is not a directory; create it or leave it unset (TMPDIR)")
        probe = Workspace(Path(), [], test_timeout, max_output_chars)  # only its methods' signatures are read
        super().__init__(list(probe.tool_functions().values()), max_turns=max_turns)
        self.tasks = {t["id"]: t for t in load_tasks(tasks)}
        self.ids = sorted(self.tasks)
        self.test_timeout, self.max_output_chars, self.workdir = test_timeout, max_output_chars, workdir

    def sample_tasks(self, n: int, rng: np.random.Generator) -> list[Task]:
        return [{"id": self.ids[int(i)]} for i in rng.integers(len(self.ids), size=n)]

    def build_prompt(self, task: Task) -> Messages:
        spec = self.task(task)
        files = "\n".join(sorted([*spec["files"], *spec["visible_tests"]]))
        content = f"{INSTRUCTIONS}\n\n## Problem\n\n{spec['problem_statement'].strip()}\n\n## Files\n\n{files}"
        return [{"role": "user", "content": content}]

    def env_response(self, task: Task, messages: Messages, calls: list[ToolCall]) -> Messages | None:
        if not calls:
            return None  # no call: the model says it is done
        with self.workspace(task, messages) as ws:  # `calls` (the last message's) are not answered yet: not replayed
            tools = ws.tool_functions()
            return [
                {"role": "tool", "tool_call_id": call.id, "content": execute_tool_call(call, tools)[0]}
                for call in calls
            ]

    def score_rollout(self, task: Task, messages: Messages) -> float:
        return 1.0 if self.test_report(task, messages).all_passed else 0.0

    def score(self, task: Task, completion_text: str) -> float:
        """Without a conversation there are no edits: the repository as given is scored (0 for a sound task)."""
        return self.score_rollout(task, [])

    def test_report(self, task: Task, messages: Messages, hidden: bool = True) -> PytestRun:
        """The hidden (or visible) tests run on the repository as the conversation's answered edits left it."""
        spec = self.task(task)
        with self.workspace(task, messages) as ws:
            suite = spec["hidden_tests"] if hidden else spec["visible_tests"]
            for rel, content in suite.items():  # over anything the model wrote there
                (ws.root / rel).parent.mkdir(parents=True, exist_ok=True)
                (ws.root / rel).write_text(content, encoding="utf-8")
            return ws.run(sorted(suite), report=True)

    def task(self, task: Task) -> dict[str, Any]:
        spec = self.tasks.get(task.get("id"))
        if spec is None:
            raise KeyError(
                f"swe_env task id {task.get('id')!r} is not in the loaded task file ({len(self.tasks)} tasks); "
                "build the environment with the task file the task was sampled from"
            )
        return spec

    @contextmanager
    def workspace(self, task: Task, messages: Messages) -> Iterator[Workspace]:
        """A fresh copy of the task's repository with every answered edit of `messages` replayed; removed on exit."""
        with Workspace.open(
            self.task(task), parent=self.workdir, test_timeout=self.test_timeout, max_output_chars=self.max_output_chars
        ) as ws:
            tools = ws.tool_functions()
            edit_tools = {name: tools[name] for name in EDIT_TOOLS}
            for call in answered_edits(messages):
                execute_tool_call(call, edit_tools)  # the same answer as the first time, which the model has seen
            yield ws


def answered_edits(messages: Messages) -> list[ToolCall]:
    """The edit calls the environment executed, in order: those of each assistant message followed by its
    tool messages (the last turn of a rollout cut at `max_turns` was never answered, so never ran)."""
    edits: list[ToolCall] = []
    for i, message in enumerate(messages[:-1]):
        if message.get("role") != "assistant" or messages[i + 1].get("role") != "tool":
            continue
        for entry in message.get("tool_calls") or []:
            fn = entry.get("function", {})
            if fn.get("name") not in EDIT_TOOLS:
                continue
            arguments = fn.get("arguments", {})
            if isinstance(arguments, str):  # OpenAI's form (ToolCall.to_message): a JSON string
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    continue
            if isinstance(arguments, dict):
                edits.append(ToolCall(str(entry.get("id", "")), fn["name"], arguments, raw=""))
    return edits
