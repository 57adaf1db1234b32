"""The `PRIME_RL_*` environment variables are one documented protocol: `prime_rl.common.env`.

Every name used anywhere (code, SLURM templates, tests, docs) is one of its constants, each constant is
documented (who sets it, who reads it, what it means), and source code reads and writes the names through
the constants, never as string literals."""

import ast
import re
from pathlib import Path

from prime_rl.common import env

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"PRIME_RL_[A-Z0-9_]+")
LITERAL = re.compile(r"""(?<![\w`])(['"])(PRIME_RL_[A-Z0-9_]+)\1""")


def _files(*patterns: str) -> list[Path]:
    return [p for pattern in patterns for p in ROOT.glob(pattern) if ".venv" not in p.parts]


def test_every_name_in_use_is_a_documented_constant():
    used = {}
    for path in _files("packages/*/src/**/*.py", "packages/*/src/**/*.j2", "packages/*/tests/**/*.py",
                       "tests/**/*.py", "docs/**/*.md", "examples/**/*", "scripts/**/*"):  # fmt: skip
        if path.is_file():
            for name in NAME.findall(path.read_text(errors="replace")):
                used.setdefault(name, path.relative_to(ROOT))
    unknown = {name: str(path) for name, path in used.items() if name not in env.ALL}
    assert not unknown, f"PRIME_RL_* names not in prime_rl.common.env: {unknown}; add a documented constant there"


def test_each_constant_is_documented_and_listed():
    tree = ast.parse(Path(env.__file__).read_text())
    documented = {}
    for stmt, following in zip(tree.body, tree.body[1:]):
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant):
            doc = following.value.value if isinstance(following, ast.Expr) else ""
            documented[stmt.value.value] = doc
    assert set(documented) == set(env.ALL) and len(env.ALL) == len(set(env.ALL))
    for name, doc in documented.items():
        assert name.startswith("PRIME_RL_") and re.search(r"\b(Set|set) by\b", doc) and "ead by" in doc, name


def test_source_uses_the_constants_not_literals():
    literals = [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
        for path in _files("packages/*/src/**/*.py")
        if path.name != "env.py"
        for text in [path.read_text()]
        for m in LITERAL.finditer(text)
    ]
    assert not literals, f"use the constants of prime_rl.common.env: {literals}"
