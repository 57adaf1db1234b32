"""The six distributions as published: lockstep versions, bounded sibling dependencies, dependencies that
match the imports, and a LICENSE and readme in each. (tests/test_release.py builds and installs them.)"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "kernels", "trainer", "inference", "orchestrator", "launcher")
# Required dependencies a package needs at run time without importing them itself.
RUNTIME_ONLY = {("trainer", "jinja2"): "transformers renders chat templates (SFT data) with it"}


def project(package: str) -> dict:
    return tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]


def requirements(package: str, extra: str | None = None) -> list[Requirement]:
    meta = project(package)
    raw = meta["dependencies"] if extra is None else meta["optional-dependencies"][extra]
    return [Requirement(r) for r in raw]


def imports(package: str, module_level_only: bool = False) -> set[str]:
    """Top-level names of the third-party and prime_rl.<sibling> modules the package's source imports."""
    found = set()
    for path in (ROOT / "packages" / package / "src").rglob("*.py"):
        tree = ast.parse(path.read_text())
        nodes = tree.body if module_level_only else ast.walk(tree)
        for node in nodes:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "prime_rl" and len(parts) > 1:
                    found.add(f"prime-rl-{parts[1]}")
                elif parts[0] not in sys.stdlib_module_names and parts[0] != "__future__":
                    found.add(parts[0])
    return found - {f"prime-rl-{package}"}


@functools.cache
def _module_to_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distribution_of(module: str) -> str | None:
    dists = _module_to_distributions().get(module)
    return dists[0].lower().replace("_", "-") if dists else None


def test_one_version_and_bounded_sibling_dependencies():
    versions = {p: project(p)["version"] for p in PACKAGES}
    assert len(set(versions.values())) == 1, f"release the packages together: {versions}"
    version = Version(versions["common"])
    for p in PACKAGES:
        extras = project(p).get("optional-dependencies", {})
        for req in requirements(p) + [r for e in extras for r in requirements(p, e)]:
            if req.name.startswith("prime-rl-") and req.name != f"prime-rl-{p}":  # not common[test] -> common[testing]
                assert version in req.specifier, f"prime-rl-{p}: {req} excludes this release {version}"
                assert any(s.operator == "<" for s in req.specifier), f"prime-rl-{p}: {req} needs an upper bound"


@pytest.mark.parametrize("package", PACKAGES)
def test_declared_siblings_are_exactly_the_imported_ones(package):
    declared = {r.name for r in requirements(package) if r.name.startswith("prime-rl-")}
    used = {m for m in imports(package) if m.startswith("prime-rl-")}
    assert declared == used


@pytest.mark.parametrize("package", PACKAGES)
def test_every_required_dependency_is_imported(package):
    """A package declares only what it imports (kernels does not pull in common just because)."""
    used = {distribution_of(m) or m for m in imports(package)}
    for req in requirements(package):
        if req.name.startswith("prime-rl-") or (package, req.name) in RUNTIME_ONLY:
            continue
        assert req.name.lower() in used, f"prime-rl-{package} declares {req.name} but never imports it"


def _provided(package: str, extras: set[str] = frozenset(), seen: set | None = None) -> set[str]:
    """Distributions a package brings: its requirements (and the given extras'), siblings' recursively."""
    seen = set() if seen is None else seen
    out: set[str] = set()
    reqs = requirements(package) + [r for e in extras for r in requirements(package, e)]
    for req in reqs:
        if req.name.startswith("prime-rl-"):
            sibling = req.name.removeprefix("prime-rl-")  # self-references (common[test]) included
            if (sibling, tuple(sorted(req.extras))) not in seen:
                seen.add((sibling, tuple(sorted(req.extras))))
                out |= _provided(sibling, set(req.extras), seen)
        else:
            out.add(req.name.lower())
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_module_level_imports_are_declared(package):
    """What a module imports at its top is a dependency of the package, of a sibling it depends on, or of
    one of its extras (e.g. inference's vLLM modules under the `cpu`/`gpu` extra)."""
    extras = set(project(package).get("optional-dependencies", {}))
    provided = _provided(package, extras)
    for module in imports(package, module_level_only=True):
        if module.startswith("prime-rl-"):
            continue
        dist = distribution_of(module)
        assert dist is None or dist in provided or dist.removesuffix("-cpu") in provided, (
            f"prime-rl-{package} imports {module} ({dist}) at module level but does not declare it"
        )


@pytest.mark.parametrize("package", PACKAGES)
def test_license_and_readme_ship_in_each_package(package):
    meta = project(package)
    assert meta["license"] == "Apache-2.0" and meta["license-files"] == ["LICENSE"]
    folder = ROOT / "packages" / package
    assert (folder / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    readme = (folder / meta["readme"]).read_text()
    assert readme.startswith(f"# prime-rl-{package}") and "pip install" in readme


def test_gpu_extra_pins_the_supported_vllm_range():
    """`pip install prime-rl-inference[gpu]` resolves a vLLM the server runs with (the range of
    prime_rl.common.vllm_compat), never the newest release that needs another torch."""
    from prime_rl.common.vllm_compat import SUPPORTED_RANGE, unsupported_reason

    (vllm,) = [r for r in requirements("inference", "gpu") if r.name == "vllm"]
    assert str(vllm.specifier) == str(Requirement(f"vllm{SUPPORTED_RANGE}").specifier)
    for version in ("0.25.0", "0.26.0", "0.32.0", "0.33.0", "0.34.0"):
        assert (Version(version) in vllm.specifier) == (unsupported_reason(version) is None), version
