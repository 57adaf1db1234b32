"""Hand a run to SLURM when its config has a ``[slurm]`` table.

`sft`, `inference` and `rl` all submit through sbatch when `[slurm]` is present (in a TOML file or as
`--slurm.*` flags). The SLURM side (templates, sbatch) lives in prime-rl-launcher, which the trainer
and inference packages must not import; so the entrypoints look for `[slurm]` here, before parsing
their own schema (which has no `[slurm]`), and re-run the same argv through
`python -m prime_rl.launcher.slurm <kind>`, which adds `[deployment] type = "multi_node"` and
`[slurm]` to the component's schema.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

from prime_rl.common import commands


def wants_slurm(argv: list[str]) -> bool:
    """True when argv sets any ``slurm`` key, directly or through an ``@ file.toml``."""
    files = [argv[i + 1] for i, tok in enumerate(argv[:-1]) if tok == "@"]
    files += [tok[1:] for tok in argv if tok.startswith("@") and len(tok) > 1]
    if any(tok == "--slurm" or tok.startswith("--slurm.") for tok in argv):
        return True
    for file in files:
        try:
            if "slurm" in tomllib.loads(Path(file).read_text()):
                return True
        except (OSError, tomllib.TOMLDecodeError):
            continue  # the component's own parser reports the bad file
    return False


def run_through_slurm(kind: str, argv: list[str], prog: str) -> int:
    """Run ``python -m prime_rl.launcher.slurm kind argv...``; exit 2 when the launcher is missing."""
    if importlib.util.find_spec("prime_rl.launcher") is None:
        sys.stderr.write(
            f"{prog}: error: the config has a [slurm] table, but prime-rl-launcher is not installed; "
            "pip install prime-rl-launcher (it writes and submits the sbatch script)\n"
        )
        return 2
    return subprocess.call(commands.slurm_command(sys.executable, kind, argv))
