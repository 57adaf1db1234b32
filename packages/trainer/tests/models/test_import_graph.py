"""The modules of `prime_rl.trainer.models` import each other without a cycle, counting imports inside functions
(a lazy import hides a cycle from Python but not from a reader: which module is built on which?)."""

from __future__ import annotations

import ast
from pathlib import Path

import prime_rl.trainer.models as models_pkg

PREFIX = "prime_rl.trainer.models."


def import_graph(folder: Path) -> dict[str, set[str]]:
    """module stem -> the sibling stems it imports anywhere in its source (the package `__init__` left out)."""
    stems = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for stem in stems:
        tree = ast.parse((folder / f"{stem}.py").read_text())
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        graph[stem] = {m.removeprefix(PREFIX).split(".")[0] for m in names if m.startswith(PREFIX)} & stems
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, white / grey / black)."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_models_package_has_no_import_cycle():
    folder = Path(models_pkg.__file__).parent
    graph = import_graph(folder)
    assert {"transformer", "nemotron_h", "self_attention"} <= graph.keys()
    assert find_cycle(graph) is None, f"import cycle among prime_rl.trainer.models modules: {find_cycle(graph)}"


def test_a_lazy_import_cycle_is_found(tmp_path):
    (tmp_path / "a.py").write_text(f"from {PREFIX}b import B\n")
    (tmp_path / "b.py").write_text(f"def f():\n    from {PREFIX}a import A\n")
    (tmp_path / "c.py").write_text(f"import {PREFIX}a\n")
    assert find_cycle(import_graph(tmp_path)) == ["a", "b", "a"]
