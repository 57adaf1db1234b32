"""A task's repository copied into a fresh temp dir, and the tools the model works on it with.

Every tool answers with a string; a bad request (a path outside the copy, a file that does not exist, an
`old` text that is missing or ambiguous) answers "error: ..." with what to do instead, because it is the
model's mistake to learn from, not the run's. Paths are relative to the copy's root; absolute paths and
paths that resolve outside it (`..`, symlinks) are refused. Names that configure or shadow pytest
(conftest.py, pytest.ini, a top-level pytest.py, ...) cannot be written: an edit there would change how the
hidden tests run rather than what they test.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from swe_env.runner import PytestRun, run_pytest

TOOL_NAMES = ("list_files", "read_file", "replace_in_file", "write_file", "run_tests")
EDIT_TOOLS = ("replace_in_file", "write_file")
"""The tools that change the repository: the ones replayed to rebuild a rollout's copy (see env.py)."""

PROTECTED_NAMES = frozenset(
    {"conftest.py", "pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg", "sitecustomize.py",
     "usercustomize.py"}
)  # fmt: skip
"""File names pytest (or Python's start-up) reads as configuration, in any directory."""
PROTECTED_TOP_LEVEL = frozenset({"pytest", "_pytest", "py", "pluggy", "iniconfig", "packaging"})
"""Modules pytest imports: a top-level file or folder of that name in the copy (first on sys.path) would replace them."""
SKIPPED_DIRS = frozenset({"__pycache__", ".pytest_cache"})


class ToolError(Exception):
    """A request the tool refuses; its message goes back to the model as "error: <message>"."""


def _tool(fn: Callable[..., str]) -> Callable[..., str]:
    """Turn a ToolError into the "error: ..." answer (functools.wraps keeps the signature the schema is read from)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> str:
        try:
            return fn(*args, **kwargs)
        except ToolError as e:
            return f"error: {e}"

    return wrapper


class Workspace:
    """One copy of a task's repository (`root`) and a scratch dir beside it (HOME, TMPDIR, test reports)."""

    def __init__(self, root: Path, visible_tests: list[str], test_timeout: float, max_output_chars: int) -> None:
        self.root, self.visible_tests = root, visible_tests
        self.test_timeout, self.max_output_chars = test_timeout, max_output_chars

    @classmethod
    @contextmanager
    def open(
        cls, task: dict[str, Any], *, parent: str | None, test_timeout: float, max_output_chars: int
    ) -> Iterator[Workspace]:
        """A fresh copy of the task's files and visible tests under a new temp dir, removed on exit."""
        base = Path(tempfile.mkdtemp(prefix="swe-env-", dir=parent))
        try:
            root = base / "repo"
            root.mkdir()
            write_files(root, {**task["files"], **task["visible_tests"]})
            yield cls(root, sorted(task["visible_tests"]), test_timeout, max_output_chars)
        finally:
            shutil.rmtree(base, ignore_errors=True)

    @property
    def scratch(self) -> Path:
        return self.root.parent

    def tool_functions(self) -> dict[str, Callable[..., str]]:
        return {name: getattr(self, name) for name in TOOL_NAMES}

    def run(self, test_paths: list[str], report: bool = False) -> PytestRun:
        return run_pytest(
            self.root, test_paths, scratch=self.scratch, timeout=self.test_timeout,
            max_output_chars=self.max_output_chars, report=report,
        )  # fmt: skip

    # --- the tools (schemas from these signatures and first docstring lines) ---

    @_tool
    def list_files(self) -> str:
        """List the repository's files, one path (relative to the repository root) per line."""
        paths = [
            p.relative_to(self.root).as_posix()
            for p in sorted(self.root.rglob("*"))
            if p.is_file() and not SKIPPED_DIRS.intersection(p.relative_to(self.root).parts)
        ]
        return "\n".join(paths) if paths else "(no files)"

    @_tool
    def read_file(self, path: str) -> str:
        """Read a file of the repository; `path` is relative to the repository root, e.g. 'src/app.py'."""
        target = self._resolve(path)
        if not target.is_file():
            raise ToolError(f"{path!r} is not a file of the repository; list_files shows the files")
        text = target.read_text(encoding="utf-8", errors="replace")
        if len(text) > self.max_output_chars:
            shown = self.max_output_chars
            return f"{text[:shown]}\n[... truncated: showing the first {shown} of {len(text)} characters]"
        return text

    @_tool
    def replace_in_file(self, path: str, old: str, new: str) -> str:
        """Replace the text `old`, which must occur exactly once in the file at `path`, with `new`."""
        target = self._resolve(path, writing=True)
        if not target.is_file():
            raise ToolError(f"{path!r} is not a file of the repository; list_files shows the files")
        if not old:
            raise ToolError("`old` is empty; give the exact text to replace (it must occur exactly once)")
        text = target.read_text(encoding="utf-8")
        count = text.count(old)
        if count == 0:
            raise ToolError(
                f"`old` does not occur in {path!r}; it must match the file exactly, whitespace and indentation "
                "included (read_file shows the current content)"
            )
        if count > 1:
            raise ToolError(
                f"`old` occurs {count} times in {path!r}; it must occur exactly once: include more of the "
                "surrounding lines to pick one"
            )
        target.write_text(text.replace(old, new, 1), encoding="utf-8")
        return f"replaced 1 occurrence in {path}"

    @_tool
    def write_file(self, path: str, content: str) -> str:
        """Create or overwrite the file at `path` (relative to the repository root) with `content`."""
        target = self._resolve(path, writing=True)
        if target.is_dir():
            raise ToolError(f"{path!r} is a directory; give a file path")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")
        return f"wrote {len(content)} characters to {path}"

    @_tool
    def run_tests(self) -> str:
        """Run the repository's visible tests (python -m pytest -q) and return their output."""
        if not self.visible_tests:
            return "this task has no visible tests"
        run = self.run(self.visible_tests)
        status = "timed out" if run.timed_out else f"exit code {run.returncode}"
        return f"{run.output.rstrip()}\n[pytest {status}]"

    def _resolve(self, path: str, writing: bool = False) -> Path:
        """The file `path` names inside the copy; ToolError for anything that would leave it."""
        if not isinstance(path, str):
            raise ToolError(f"path {path!r} must be a string, relative to the repository root, e.g. 'app.py'")
        if not path.strip():
            raise ToolError(f"path {path!r} is empty; give a path relative to the repository root, e.g. 'app.py'")
        pure = PurePosixPath(path)
        if pure.is_absolute() or path.startswith("~"):
            raise ToolError(
                f"path {path!r} is absolute; paths are relative to the repository root, e.g. 'app.py' "
                "(list_files shows them)"
            )
        root = self.root.resolve()
        try:
            target = (root / pure).resolve()
        except (OSError, ValueError) as e:  # e.g. a NUL byte in the path
            raise ToolError(f"path {path!r} is not a valid path: {e}") from None
        if target == root or not target.is_relative_to(root):
            raise ToolError(f"path {path!r} leaves the repository; only files inside it can be read or written")
        if writing:
            parts = target.relative_to(root).parts
            top = parts[0].removesuffix(".py")
            if PROTECTED_NAMES.intersection(parts) or top in PROTECTED_TOP_LEVEL:
                raise ToolError(
                    f"{path!r} would configure or replace pytest, which runs the hidden tests; fix the code "
                    "under test instead"
                )
        return target


def write_files(root: Path, files: dict[str, str]) -> None:
    for rel, content in files.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")
