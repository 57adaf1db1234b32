"""The package boundaries of DESIGN.md hold: who may import whom, and who must never import torch/vllm.

Two checks: static (ast over every source file: no package imports a sibling it may not depend on,
even inside a function) and dynamic (import every module in a fresh interpreter and look at
``sys.modules``, which also catches heavy imports pulled in transitively through a third-party library).
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "kernels", "trainer", "inference", "orchestrator", "launcher")
ALLOWED = {
    "common": {"common"},
    "kernels": {"kernels", "common"},
    "trainer": {"trainer", "kernels", "common"},
    "inference": {"inference", "common"},
    "orchestrator": {"orchestrator", "common"},
    "launcher": {"launcher", "common"},
}
FORBIDDEN_AT_RUNTIME = {
    "common": {"torch", "vllm"},
    "orchestrator": {"torch", "vllm"},
    "launcher": {"torch", "vllm"},
}


def _source_root(package: str) -> Path:
    return ROOT / "packages" / package / "src"


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported_modules(path: Path, src: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a file, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _module_name(path, src)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            if target == "prime_rl":  # from prime_rl import trainer
                found += [(node.lineno, f"prime_rl.{alias.name}") for alias in node.names]
    return found


def _violations(package: str) -> list[str]:
    src = _source_root(package)
    problems = []
    for path in sorted(src.rglob("*.py")):
        for line, name in _imported_modules(path, src):
            parts = name.split(".")
            if parts[0] != "prime_rl" or len(parts) < 2:
                continue
            if parts[1] not in ALLOWED[package]:
                rel = path.relative_to(ROOT)
                problems.append(
                    f"{rel}:{line} imports {name}; prime_rl.{package} may import only {sorted(ALLOWED[package])}"
                )
    return problems


@pytest.mark.parametrize("package", PACKAGES)
def test_no_forbidden_sibling_imports(package):
    assert _violations(package) == []


def test_the_static_check_can_fail(tmp_path, monkeypatch):
    # Guard against a check that passes vacuously: plant a violation in a fake source tree.
    src = tmp_path / "packages" / "launcher" / "src"
    (src / "prime_rl" / "launcher").mkdir(parents=True)
    (src / "prime_rl" / "launcher" / "bad.py").write_text(
        "def f():\n    from prime_rl.trainer import model\n    from ..inference import server\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    problems = _violations("launcher")
    assert len(problems) == 2 and "prime_rl.trainer" in problems[0] and "prime_rl.inference" in problems[1]


_IMPORT_ALL = """
import importlib, json, pkgutil, sys
package = importlib.import_module(sys.argv[1])
errors = {}
for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    if info.name.rsplit(".", 1)[-1] == "__main__":
        continue
    try:
        importlib.import_module(info.name)
    except Exception as e:
        errors[info.name] = f"{type(e).__name__}: {e}"
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "vllm", "transformers", "triton"})
print(json.dumps({"heavy": heavy, "errors": errors}))
"""


@pytest.mark.parametrize("package", sorted(FORBIDDEN_AT_RUNTIME))
def test_light_packages_never_import_torch_or_vllm(package):
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, f"prime_rl.{package}"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["errors"] == {}, f"modules of prime_rl.{package} fail to import: {report['errors']}"
    leaked = set(report["heavy"]) & FORBIDDEN_AT_RUNTIME[package]
    assert not leaked, f"importing every module of prime_rl.{package} pulled in {sorted(leaked)}"
