"""The task format: one JSON object per line of a JSONL file, checked once when the environment is built.

    {"id": "pager-off-by-one",
     "problem_statement": "paginate(items, 1, 2) returns the second page ...",
     "files": {"pager.py": "..."},                         # the repository the model edits
     "visible_tests": {"tests/test_pager.py": "..."},      # what run_tests runs; the model can read them
     "hidden_tests": {"tests/test_pager_hidden.py": "..."},# written only at scoring time: the reward
     "reference_patch": [{"path": "pager.py", "old": "...", "new": "..."}]}   # optional: a known fix

`reference_patch` is a list of `replace_in_file` edits (the tool's own rule: `old` occurs exactly once), so
`python -m swe_env.check` can check a dataset through the environment itself: hidden tests fail on the
repository as given and pass after the reference patch.

Paths are relative POSIX paths without `..`; the three file maps must not share a path (a hidden test
that replaced a source file would score another repository than the model edited).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

Task = dict[str, Any]

FILE_MAPS = ("files", "visible_tests", "hidden_tests")
BUNDLED = "bundled"
"""`tasks = "bundled"` (the default): the tasks shipped in this package (swe_env/data/tasks.jsonl)."""


class TaskFormatError(ValueError):
    """A task file that does not follow the format above; the message names the line and the field."""


def bundled_tasks_path() -> Path:
    return Path(str(resources.files("swe_env") / "data" / "tasks.jsonl"))


def load_tasks(path: str | Path = BUNDLED) -> list[Task]:
    """Every task of a JSONL file (or the bundled ones), validated; ids are unique."""
    source = bundled_tasks_path() if str(path) == BUNDLED else Path(path).expanduser()
    if not source.is_file():
        raise FileNotFoundError(
            f"swe_env tasks={str(path)!r}: no such file; give the path of a JSONL task file (one task per line, "
            f"see the swe_env README) or {BUNDLED!r} for the bundled tasks"
        )
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(source.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskFormatError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); one task per line") from e
        task = validate_task(raw, where)
        if task["id"] in seen:
            raise TaskFormatError(
                f"{where}: id {task['id']!r} is also the id of line {seen[task['id']]}; ids must be unique"
            )
        seen[task["id"]] = lineno
        tasks.append(task)
    if not tasks:
        raise TaskFormatError(f"{source}: no tasks; a task file needs at least one JSON object per line")
    return tasks


def validate_task(raw: Any, where: str = "task") -> Task:
    """The task if it follows the format, else a TaskFormatError naming the field, the value and the rule."""
    if not isinstance(raw, dict):
        raise TaskFormatError(f"{where}: a task must be a JSON object, got {type(raw).__name__}")
    for key in ("id", "problem_statement"):
        if not isinstance(raw.get(key), str) or not raw[key].strip():
            raise TaskFormatError(f"{where}: {key!r} must be a non-empty string, got {raw.get(key)!r}")
    where = f"{where} (id {raw['id']!r})"
    owner: dict[str, str] = {}
    for key in FILE_MAPS:
        files = raw.get(key)
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise TaskFormatError(
                f"{where}: {key!r} must be an object of path -> file content (strings), got {files!r:.80}"
            )
        for path in files:
            check_relative_path(path, f"{where}: {key}")
            if path in owner:
                raise TaskFormatError(f"{where}: {path!r} is in both {owner[path]!r} and {key!r}; use distinct paths")
            owner[path] = key
    if not raw["hidden_tests"]:
        raise TaskFormatError(f"{where}: 'hidden_tests' is empty; the reward needs at least one hidden test file")
    patch = raw.get("reference_patch")
    if patch is not None and not (
        isinstance(patch, list)
        and all(isinstance(e, dict) and all(isinstance(e.get(k), str) for k in ("path", "old", "new")) for e in patch)
    ):
        raise TaskFormatError(
            f"{where}: 'reference_patch' must be a list of {{path, old, new}} strings, got {patch!r:.80}"
        )
    return raw


def check_relative_path(path: str, where: str) -> None:
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or ".." in pure.parts or "\\" in path:
        raise TaskFormatError(f"{where}: path {path!r} must be relative, with '/' separators and no '..'")
