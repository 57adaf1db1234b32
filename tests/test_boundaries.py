"""The package boundaries of DESIGN.md hold: who may import whom, and who must never import torch/vllm.

``prime_rl.common.weight_sync`` is the one torch-level corner of common (the weight-transfer protocol
shared by trainer and inference, ``prime-rl-common[torch]``): it may import torch, never vllm, and no
torch-free module may import it -- not the rest of common, not the orchestrator, not the launcher.

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
TORCH_LEVEL = "prime_rl.common.weight_sync"
"""The torch-level home of the weight-transfer protocol (skipped by common's torch-free runtime check)."""
TORCH_FREE_IMPORTERS = ("common", "orchestrator", "launcher")


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


def _torch_level_importers(package: str) -> list[str]:
    """Torch-free modules of ``package`` that import the torch-level weight-sync package."""
    src = _source_root(package)
    problems = []
    for path in sorted(src.rglob("*.py")):
        module = _module_name(path, src)
        if module == TORCH_LEVEL or module.startswith(TORCH_LEVEL + "."):
            continue
        for line, name in _imported_modules(path, src):
            if name == TORCH_LEVEL or name.startswith(TORCH_LEVEL + "."):
                problems.append(f"{path.relative_to(ROOT)}:{line} imports {name}, which imports torch")
    return problems


@pytest.mark.parametrize("package", TORCH_FREE_IMPORTERS)
def test_torch_free_modules_never_import_the_torch_level_weight_sync(package):
    assert _torch_level_importers(package) == []


def test_the_torch_level_check_can_fail(tmp_path, monkeypatch):
    src = tmp_path / "packages" / "orchestrator" / "src" / "prime_rl" / "orchestrator"
    src.mkdir(parents=True)
    (src / "bad.py").write_text("from prime_rl.common.weight_sync.broadcast import WeightGroup\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert len(_torch_level_importers("orchestrator")) == 1


_IMPORT_ALL = """
import importlib, json, pkgutil, sys
skip = sys.argv[2] if len(sys.argv) > 2 else None
errors = {}
def walk(name):
    if name.rsplit(".", 1)[-1] == "__main__" or (skip and (name == skip or name.startswith(skip + "."))):
        return
    try:
        module = importlib.import_module(name)
    except Exception as e:
        errors[name] = f"{type(e).__name__}: {e}"
        return
    for info in pkgutil.iter_modules(getattr(module, "__path__", []), name + "."):
        walk(info.name)
walk(sys.argv[1])
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "vllm", "transformers", "triton"})
print(json.dumps({"heavy": heavy, "errors": errors}))
"""


@pytest.mark.parametrize("package", sorted(FORBIDDEN_AT_RUNTIME))
def test_light_packages_never_import_torch_or_vllm(package):
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, f"prime_rl.{package}", TORCH_LEVEL],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["errors"] == {}, f"modules of prime_rl.{package} fail to import: {report['errors']}"
    leaked = set(report["heavy"]) & FORBIDDEN_AT_RUNTIME[package]
    assert not leaked, f"importing every module of prime_rl.{package} pulled in {sorted(leaked)}"


def test_the_torch_level_weight_sync_never_imports_vllm():
    pytest.importorskip("torch")
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, TORCH_LEVEL], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["errors"] == {}, report["errors"]
    assert "torch" in report["heavy"] and not {"vllm", "transformers"} & set(report["heavy"])
