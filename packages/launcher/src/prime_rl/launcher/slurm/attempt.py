"""``python -m prime_rl.launcher.slurm.attempt OUTPUT_DIR RUN_NAME``: start a log attempt, print its number.

The job script calls this on the batch node, once per job, so every process of one SLURM job logs
under the same ``logs/attempt_<n>`` (and ``logs/latest`` points at it).
"""

import sys

from prime_rl.common.rundir import RunDir


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        sys.stderr.write("usage: python -m prime_rl.launcher.slurm.attempt OUTPUT_DIR RUN_NAME\n")
        raise SystemExit(2)
    print(RunDir(args[0], args[1]).start_attempt())


if __name__ == "__main__":
    main()
