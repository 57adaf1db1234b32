"""Start-up time of the command-line entrypoints: `--help` of each, and `rl --dry-run` on the arithmetic example.

    python benchmarks/cli_startup.py [--repeats 10] [--importtime-top 15]

Each command runs `--repeats` times, each time in a fresh Python process, exactly as its console script
does (the `[project.scripts]` entry of the package's pyproject.toml, imported from this checkout's
`packages/*/src`); the wall time of the whole process is what a user waits for. The dry run resolves
`examples/arithmetic/rl.toml` against a tiny model and writes its configs into a temporary directory.
Bytecode: by default the children compile into a temporary `PYTHONPYCACHEPREFIX`, and one untimed run
per command fills it first, so the numbers are those of an installed package (pip compiles .pyc files);
`--no-bytecode-cache` times them with `PYTHONDONTWRITEBYTECODE=1` instead, as on the shared dev
machine's environment, where every start compiles this checkout's sources again (about 50 ms of `rl`).
`--baseline DIR` (another checkout, e.g. `git worktree add /tmp/base <commit>`) times that checkout's
commands too, alternating sample by sample with this one's, so that both see the same machine load: on
the shared dev machine the load moves single runs by up to 2x, and this is the fair before/after.
`rl --help` and `sft --help` go through the console scripts, which print the text the last `--help` stored
(`prime_rl.common.help_cache`; the untimed warm-up stores it, as a user's first `--help` does);
`rl --help, rendered` and `sft --help, rendered` call the commands' mains, which render it every time, as on
the first `--help` after the code changed (and every one under `--no-bytecode-cache`, where nothing is stored).
Then one `python -X importtime` run of `rl --help` and of `sft --help` lists the modules that cost the
most (cumulative, and self time), which is where to look when a number regresses.

Prints one JSON object: per command the median and min seconds (and every sample), plus the offenders;
with `--baseline`, the baseline's numbers under "baseline_commands".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RENDERED = {"rl": "prime_rl.launcher.rl:main", "sft": "prime_rl.trainer.sft.entrypoint:main"}
"""the commands' own mains: they render `--help` every time, where the console scripts print the stored text"""


def entry_points(root: Path = ROOT) -> dict[str, str]:
    """Console script name -> "module:function", from every package's pyproject.toml."""
    scripts = {}
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        scripts.update(tomllib.loads(pyproject.read_text())["project"].get("scripts", {}))
    return scripts


def script_argv(entry: str, name: str, args: list[str], python_flags: list[str] = ()) -> list[str]:
    """A `python -c` command that runs `entry` the way its console script does."""
    module, func = entry.split(":")
    code = f"import sys; from {module} import {func}; sys.argv[0] = {name!r}; sys.exit({func}())"
    return [sys.executable, *python_flags, "-c", code, *args]


def child_env(pycache: str | None, root: Path = ROOT) -> dict[str, str]:
    """``root``'s packages first on the path; bytecode cached under ``pycache`` (None: not written)."""
    src = [str(p) for p in sorted((root / "packages").glob("*/src"))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(src + [os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTHONPYCACHEPREFIX", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if pycache is None:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        env["PYTHONPYCACHEPREFIX"] = pycache
    return env


def time_commands(runs: list[tuple[list[str], dict[str, str]]], repeats: int) -> list[list[float]]:
    """Wall seconds of each (argv, env), ``repeats`` samples each, taken in turn (a, b, a, b, ...)."""
    samples: list[list[float]] = [[] for _ in runs]
    for argv, env in runs:
        subprocess.run(argv, env=env, capture_output=True)  # warm-up: fills the bytecode cache, untimed
    for _ in range(repeats):
        for (argv, env), out in zip(runs, samples):
            start = time.perf_counter()
            proc = subprocess.run(argv, env=env, capture_output=True, text=True)
            out.append(time.perf_counter() - start)
            if proc.returncode != 0:
                raise RuntimeError(f"{argv[-4:]} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return samples


def summary(samples: list[float]) -> dict:
    return {
        "median_s": round(statistics.median(samples), 4),
        "min_s": round(min(samples), 4),
        "samples_s": [round(s, 4) for s in samples],
    }


def import_offenders(argv: list[str], env: dict[str, str], top: int) -> dict[str, list]:
    """The `top` modules by cumulative and by self import time (microseconds) in one `-X importtime` run."""
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    rows = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cumulative_us, name = line.removeprefix("import time:").split("|")
        rows.append((name.strip(), int(self_us), int(cumulative_us)))
    return {
        "total_ms": round(sum(r[1] for r in rows) / 1000, 1),
        "cumulative_us": [[n, c] for n, _, c in sorted(rows, key=lambda r: -r[2])[:top]],
        "self_us": [[n, s] for n, s, _ in sorted(rows, key=lambda r: -r[1])[:top]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--importtime-top", type=int, default=15)
    parser.add_argument("--no-bytecode-cache", action="store_true", help="PYTHONDONTWRITEBYTECODE=1 in every child")
    parser.add_argument("--baseline", type=Path, help="another checkout, timed alternately with this one")
    args = parser.parse_args()

    scripts = entry_points()
    with tempfile.TemporaryDirectory() as tmp:
        env = child_env(None if args.no_bytecode_cache else f"{tmp}/pycache")
        trees = [(scripts, env)]
        if args.baseline is not None:
            base_env = child_env(None if args.no_bytecode_cache else f"{tmp}/pycache-baseline", args.baseline)
            trees.append((entry_points(args.baseline), base_env))
        # a tiny model for the dry run (its checks read config.json); numpy + tokenizers, no torch
        make_model = f"from prime_rl.common.testing import make_tiny_model; make_tiny_model({tmp!r} + '/model')"
        subprocess.run([sys.executable, "-c", make_model], env=env, check=True)
        dry_run = [
            "@", str(ROOT / "examples/arithmetic/rl.toml"),
            "--model.name", f"{tmp}/model", "--output-dir", f"{tmp}/out", "--dry-run",
        ]  # fmt: skip
        names = ("rl", "sft", "trainer", "inference", "orchestrator", "eval")
        commands = {f"{name} --help": (name, name, ["--help"]) for name in names}
        # the same help rendered by the command itself, as on the first `--help` after a code change
        commands.update({f"{name} --help, rendered": (name, RENDERED[name], ["--help"]) for name in RENDERED})
        commands["rl @ examples/arithmetic/rl.toml --dry-run"] = ("rl", "rl", dry_run)

        results, baseline = {}, {}
        for label, (name, entry, argv) in commands.items():
            runs = [
                (script_argv(tree_scripts.get(entry, entry), name, argv), tree_env) for tree_scripts, tree_env in trees
            ]
            samples = time_commands(runs, args.repeats)
            results[label] = summary(samples[0])
            if args.baseline is not None:
                baseline[label] = summary(samples[1])
        offenders = {
            f"{name} --help": import_offenders(
                script_argv(scripts[name], name, ["--help"], ["-X", "importtime"]), env, args.importtime_top
            )
            for name in ("rl", "sft")
        }
    load = os.getloadavg()
    print(
        json.dumps(
            {
                "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "loadavg_1m": round(load[0], 2),
                "repeats": args.repeats,
                "bytecode_cache": not args.no_bytecode_cache,
                "commands": results,
                **({"baseline": str(args.baseline), "baseline_commands": baseline} if baseline else {}),
                "importtime": offenders,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
