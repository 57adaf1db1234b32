"""``python -m prime_rl.launcher.slurm <sft|inference|rl> @ cfg.toml [--key value ...] [--dry-run]``.

Writes ``<run_dir>/launcher/<kind>.sbatch``, ``launcher/<kind>.toml`` and ``configs/*.toml``; with
``--dry-run`` it stops there, otherwise it submits with ``sbatch --parsable`` and prints the job id
(and, for ``inference`` / ``rl``, where the router will listen). Bad input exits 2 with one line.
"""

from __future__ import annotations

import sys
import warnings

from prime_rl.common.config import ConfigError, ConfigWarning
from prime_rl.common.config.cli_help import format_help
from prime_rl.launcher.slurm.job import KINDS, component_class, job_class, load_job
from prime_rl.launcher.slurm.submit import SubmitError, router_url, submit, write_job

PROG = "python -m prime_rl.launcher.slurm"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in KINDS:
        sys.stderr.write(f"usage: {PROG} {{{'|'.join(KINDS)}}} @ config.toml [--section.key value ...] [--dry-run]\n")
        return 0 if args and args[0] in ("-h", "--help") else 2
    kind, rest = args[0], args[1:]
    if "-h" in rest or "--help" in rest:  # the component's options plus [deployment] and [slurm]
        at = rest.index("-h" if "-h" in rest else "--help")
        section = rest[at + 1] if at + 1 < len(rest) and not rest[at + 1].startswith("-") else None
        sys.stdout.write(format_help(job_class(component_class(kind)), f"{PROG} {kind}", section))
        return 0
    dry_run = "--dry-run" in rest
    rest = [a for a in rest if a != "--dry-run"]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConfigWarning)
            job = load_job(kind, rest)
        written = write_job(job)
    except ConfigError as e:
        sys.stderr.write(f"{kind}: error: {e}\n")
        return 2
    for w in caught:
        if issubclass(w.category, ConfigWarning):
            sys.stderr.write(f"{kind}: warning: {w.message}\n")
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    dry_run = dry_run or bool(getattr(job.config, "dry_run", False))
    print(f"wrote {written.script}")
    for path in [written.submitted_config, *written.process_configs.values()]:
        print(f"wrote {path}")
    if dry_run:
        return 0
    try:
        job_id = submit(written.script)
    except SubmitError as e:
        sys.stderr.write(f"{kind}: error: {e}\n")
        return 1
    print(f"submitted job {job_id}: logs in {job.run_dir.launcher_dir / 'logs'}")
    if KINDS[kind].places_inference:
        print(f"router: {router_url(job_id, job.slurm.router_port)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
