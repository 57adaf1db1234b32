"""Start distributed code the way tests do: N local ranks under torchrun, gloo on CPU.

One helper instead of a hand-built `torch.distributed.run` command per test module, so every distributed
test gets the same launcher (`prime_rl.trainer.torchrun_loopback`: the rendezvous store on 127.0.0.1, as
`rl` and `sft` run), one thread per rank (2 ranks on 2 cores would otherwise oversubscribe), a timeout,
and a failure message that shows what the ranks printed.
"""

from __future__ import annotations

import os
import subprocess
import sys

from prime_rl.common.commands import TORCHRUN_LOOPBACK


def torchrun(
    *argv: str | os.PathLike[str],
    nproc: int,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    check: bool = True,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (a script and its arguments, or ``"-m", module, ...``) on ``nproc`` local ranks.

    ``env`` is added to this process's environment (OMP_NUM_THREADS=1 unless given). With ``check`` a
    non-zero exit fails the calling test with the tail of both streams; the finished process is returned.
    """
    cmd = [sys.executable, "-m", TORCHRUN_LOOPBACK, "--nproc-per-node", str(nproc), *(str(a) for a in argv)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{nproc} ranks of {' '.join(str(a) for a in argv[:3])} exited {proc.returncode}:\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc
