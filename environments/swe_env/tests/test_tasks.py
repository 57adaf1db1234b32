"""The bundled tasks are sound (hidden tests fail unfixed, pass with the reference patch) and bad task files
fail at build time with the line and the rule."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from swe_env import SWEEnvironment, load_tasks
from swe_env.check import check_task, main
from swe_env.tasks import TaskFormatError, bundled_tasks_path

PACKAGE = Path(__file__).resolve().parents[1]
BUNDLED_IDS = [t["id"] for t in load_tasks()]


@pytest.mark.parametrize("task_id", BUNDLED_IDS)
def test_bundled_task_fails_unfixed_and_passes_with_its_reference_patch(env, task_id):
    task = {"id": task_id}
    assert env.score_rollout(task, env.build_prompt(task)) == 0.0
    assert check_task(env, task) == []  # unfixed: hidden fail; reference patch: hidden and visible pass


def test_bundled_tasks_are_distinct_and_the_generator_output():
    spec = importlib.util.spec_from_file_location("swe_make_tasks", PACKAGE / "make_tasks.py")
    make_tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tasks)
    assert bundled_tasks_path().read_text(encoding="utf-8") == make_tasks.render(), (
        "src/swe_env/data/tasks.jsonl is stale: run python environments/swe_env/make_tasks.py"
    )
    tasks = load_tasks()
    assert len(tasks) >= 8
    assert len({json.dumps(t["files"], sort_keys=True) for t in tasks}) == len(tasks)
    assert all(t["reference_patch"] for t in tasks)


def test_sampling_is_seeded_and_the_prompt_shows_files_not_hidden_tests(env):
    tasks = env.sample_tasks(16, np.random.default_rng(3))
    assert tasks == env.sample_tasks(16, np.random.default_rng(3))
    assert {t["id"] for t in tasks} <= set(BUNDLED_IDS) and len({t["id"] for t in tasks}) > 1
    spec = env.task(tasks[0])
    (prompt,) = env.build_prompt(tasks[0])
    assert spec["problem_statement"].strip() in prompt["content"]
    assert all(path in prompt["content"] for path in [*spec["files"], *spec["visible_tests"]])
    assert not any(path in prompt["content"] for path in spec["hidden_tests"])
    with pytest.raises(KeyError, match="not in the loaded task file"):
        env.task({"id": "no-such-task"})


def _line(**overrides) -> str:
    task = {
        "id": "t",
        "problem_statement": "fix it",
        "files": {"a.py": "X = 1\n"},
        "visible_tests": {},
        "hidden_tests": {"test_a.py": "from a import X\n\ndef test_x():\n    assert X == 2\n"},
        **overrides,
    }
    return json.dumps(task)


@pytest.mark.parametrize(
    "lines, match",
    [
        (["{oops"], r"tasks.jsonl:1: not valid JSON"),
        ([_line(), _line()], r":2: id 't' is also the id of line 1"),
        ([_line(files={"../a.py": ""})], r"path '../a.py' must be relative"),
        ([_line(files={"/etc/a.py": ""})], r"path '/etc/a.py' must be relative"),
        ([_line(visible_tests={"a.py": ""})], r"'a.py' is in both 'files' and 'visible_tests'"),
        ([_line(hidden_tests={})], r"'hidden_tests' is empty"),
        ([_line(files=["a.py"])], r"'files' must be an object of path -> file content"),
        ([_line(problem_statement="")], r"'problem_statement' must be a non-empty string"),
        ([_line(reference_patch=[{"path": "a.py"}])], r"'reference_patch' must be a list of \{path, old, new\}"),
        ([""], r"no tasks"),
    ],
)
def test_bad_task_files_fail_with_line_and_rule(tmp_path, lines, match):
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TaskFormatError, match=match):
        SWEEnvironment(str(path))


def test_own_task_file_and_the_check_cli(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no such file"):
        SWEEnvironment(str(tmp_path / "missing.jsonl"))
    path = tmp_path / "tasks.jsonl"
    fix = [{"path": "a.py", "old": "X = 1", "new": "X = 2"}]
    path.write_text(_line(id="good", reference_patch=fix) + "\n" + _line(id="no-fix") + "\n")
    assert main([str(path)]) == 1  # "no-fix" has no reference patch to check
    out = capsys.readouterr().out
    assert "ok   good" in out and "FAIL no-fix" in out and "no reference_patch" in out
    assert SWEEnvironment(str(path)).ids == ["good", "no-fix"]
