"""The release as users get it: scripts/release.sh builds a wheel and an sdist of all six packages, and
the six wheels install together into a fresh venv where every console script answers --help."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "kernels", "trainer", "inference", "orchestrator", "launcher")
VERSION = tomllib.loads((ROOT / "packages/common/pyproject.toml").read_text())["project"]["version"]

pytestmark = pytest.mark.slow  # about two minutes: torch, transformers and pyarrow install into a fresh venv


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert out.returncode == 0, f"{cmd}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_release_builds_all_six_and_they_install_together(tmp_path):
    dist = tmp_path / "dist"
    _run(["bash", ROOT / "scripts/release.sh"], env={**_env(), "DIST": str(dist), "PYTHON": sys.executable})
    for p in PACKAGES:
        wheel = dist / f"prime_rl_{p}-{VERSION}-py3-none-any.whl"
        sdist = dist / f"prime_rl_{p}-{VERSION}.tar.gz"
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
            metadata = z.read(f"prime_rl_{p}-{VERSION}.dist-info/METADATA").decode()
        assert f"prime_rl_{p}-{VERSION}.dist-info/licenses/LICENSE" in names
        assert "License-Expression: Apache-2.0" in metadata and f"# prime-rl-{p}" in metadata  # readme
        assert not any(n.startswith("prime_rl/__init__") for n in names)  # PEP 420 namespace
        with tarfile.open(sdist) as t:
            assert {f"prime_rl_{p}-{VERSION}/LICENSE", f"prime_rl_{p}-{VERSION}/README.md"} <= set(t.getnames())

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv])
    (tmp_path / "constraints.txt").write_text("torch==2.13.0\n")  # the CPU wheel on this machine: no download
    wheels = sorted(dist.glob("*.whl"))
    _run([venv / "bin/pip", "install", "--quiet", "--find-links", dist, "-c", tmp_path / "constraints.txt", *wheels],
         env=_env(), timeout=900)  # fmt: skip
    _run([venv / "bin/pip", "check"])
    for script in ("rl", "sft", "inference", "orchestrator", "trainer", "dashboard"):
        out = _run([venv / "bin" / script, "--help"], cwd=tmp_path, timeout=120)
        assert "usage:" in out.stdout, script
    code = (
        "import prime_rl.trainer.sft.train, prime_rl.kernels, prime_rl.launcher.rl, prime_rl.orchestrator.orchestrator"
    )
    _run([venv / "bin/python", "-c", code], cwd=tmp_path)


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
