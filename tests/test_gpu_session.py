"""benchmarks/gpu_session.sh plans the scarce GPU calls: its items must name files and flags that exist, so a
renamed test or benchmark flag fails here on CPU instead of costing device time."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": "/tmp/gpu-session-test"}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=ROOT)


def _items() -> list[str]:
    listed = _run("--list")
    assert listed.returncode == 0, listed.stderr
    return [line.split()[0] for line in listed.stdout.splitlines()]


def test_every_item_names_files_that_exist():
    items = _items()
    assert {"install", "gputests", "rlsystem", "trainer"} <= set(items)
    plan = _run("--dry-run", *items)
    assert plan.returncode == 0, plan.stderr
    paths = re.findall(r"(?<![\w./-])((?:packages|tests|benchmarks)/[\w./-]+\.(?:py|sh))", plan.stdout)
    assert len(paths) > 10, plan.stdout
    missing = [p for p in paths if not (ROOT / p).is_file()]
    assert not missing, f"gpu_session.sh names files that do not exist: {missing}"


def test_every_benchmark_flag_an_item_passes_is_accepted():
    plan = _run("--dry-run", *_items()).stdout
    for script, flags in re.findall(r"(benchmarks/\w+\.py)((?: --[\w-]+(?: [^-&|\s][^\s&|]*)?)*)", plan):
        own = flags.split(" --extra ")[0]  # what follows --extra goes to `rl` (rl_system.py passes it on)
        used = set(re.findall(r"--[\w-]+", own + (" --extra" if " --extra " in flags else "")))
        if not used:
            continue
        help_text = subprocess.run(
            [sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120
        ).stdout
        unknown = sorted(f for f in used if f not in help_text)
        assert not unknown, f"{script} has no {unknown} (gpu_session.sh passes them)"


def test_an_unknown_item_stops_before_anything_runs():
    result = _run("install", "rl_sytem")
    assert result.returncode == 2
    assert "unknown item 'rl_sytem'" in result.stderr and "rlsystem" in result.stderr
    assert "== install" not in result.stderr  # nothing ran: a typo must not cost device time
