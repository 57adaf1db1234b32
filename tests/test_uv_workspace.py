"""The seed's users type `uv sync --all-packages` then `uv run rl @ rl.toml`: the root pyproject.toml is a uv
workspace over the six packages. Checked on a copy of the checkout (the files git knows, as a fresh
clone has them) with its own environment, so nothing here touches this checkout's .venv.

CUDA torch (about 3 GB of torch/triton/nvidia wheels) is resolved and locked but not installed: the
entrypoints' --help imports none of it. The SLURM template's default install step
(`uv sync --all-extras --all-packages`) is checked as far as resolution (`--dry-run`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prime_rl.common.config.deployment import SlurmConfig

ROOT = Path(__file__).resolve().parents[1]
UV = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
HEAVY = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")

pytestmark = [
    pytest.mark.slow,  # about a minute: resolves ~250 packages and installs ~50 from the registry
    pytest.mark.skipif(not Path(UV).exists(), reason="uv is not installed (pip install uv)"),
]


def _copy_checkout(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split("\0")  # fmt: skip
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def _uv(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    out = subprocess.run([UV, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"uv {' '.join(args)}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_uv_sync_all_packages_then_uv_run_the_entrypoints(tmp_path):
    checkout = tmp_path / "prime-rl"
    _copy_checkout(checkout)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT")}
    env["UV_PROJECT_ENVIRONMENT"] = str(tmp_path / "venv")

    # the SLURM template's default install step resolves on a fresh checkout
    assert SlurmConfig().install_command == "uv sync --all-extras --all-packages"
    _uv(["sync", "--all-extras", "--all-packages", "--dry-run"], checkout, env)

    plan = _uv(["sync", "--all-packages", "--dry-run"], checkout, env).stderr
    heavy = sorted({m for m in re.findall(r"^ \+ ([\w.-]+)==", plan, re.M) if HEAVY.match(m)})
    assert "torch" in heavy
    skip = [arg for name in heavy for arg in ("--no-install-package", name)]
    _uv(["sync", "--all-packages", *skip], checkout, env)
    for script in ("rl", "sft", "inference", "dashboard"):
        out = _uv(["run", "--no-sync", script, "--help"], checkout, env)
        assert "usage:" in out.stdout, script
