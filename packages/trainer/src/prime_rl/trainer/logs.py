"""Per-rank output files: every rank's stdout/stderr goes to logs/<attempt>/trainer/torchrun/<rank>.log;
rank 0 also keeps its console (through `tee`), the others are silent on the console.

This is torchrun's `--redirects 3 --tee 3 --local-ranks-filter 0`, but with the file names the run
directory promises (torchrun's own --log-dir adds a random sub-directory per job). Done at the file
descriptor level, so C++ warnings, NCCL messages and crash tracebacks land in the file too. `tee`
is a child process: it drains the pipe even when Python dies abruptly.
"""

import os
import subprocess
import sys
from pathlib import Path

_tee: subprocess.Popen | None = None


def redirect_rank_output(log_path: Path, console: bool) -> None:
    global _tee
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if console:
        _tee = subprocess.Popen(["tee", "-a", str(log_path)], stdin=subprocess.PIPE, stdout=os.dup(1))
        target = _tee.stdin.fileno()
    else:
        target = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(target, 1)
    os.dup2(target, 2)
    # line-buffered so the file and the console stay in order, and nothing sits in a buffer at a crash
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
