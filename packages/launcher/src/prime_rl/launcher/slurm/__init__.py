"""Multi-node runs through SLURM: ``python -m prime_rl.launcher.slurm <sft|inference|rl> @ cfg.toml [--dry-run]``.

The ``sft``, ``inference`` and ``rl`` entrypoints hand a config with a ``[slurm]`` table to this module
(the trainer and inference packages may not import the launcher, so they run it as a subprocess).

Design decisions:
- The job script is a Jinja2 template (``prime_rl/launcher/templates/<kind>.sbatch.j2``); everything
  that can be decided at submit time (ports, paths, commands, env vars) is computed here in Python and
  handed to the template, so the template stays readable and a user's own (``slurm.template_path``)
  can ``{% extends "sft.sbatch.j2" %}`` and override one block.
- Node placement happens inside the job (``scontrol show hostnames``): inference nodes first, trainer
  nodes next; the router runs on inference node 0, the orchestrator on the first trainer node.
- Each process gets a config without ``[slurm]`` (and with a single-node ``[deployment]``), written to
  ``<run_dir>/configs/``: a rank never re-submits itself. The submitted config is kept as
  ``launcher/<kind>.toml`` so ``<kind> @ launcher/<kind>.toml`` submits the same job again.
- One ``srun --kill-on-bad-exit=1`` step per (component, node), supervised with ``wait -n``: the first
  component to fail stops the others and the job exits non-zero (state FAILED); the exit code is also
  written to ``launcher/job_<id>.exitcode`` because ``sacct`` needs slurmdbd, which many clusters lack.
"""

from prime_rl.launcher.slurm.job import KINDS, SlurmJob, load_job
from prime_rl.launcher.slurm.render import render_job
from prime_rl.launcher.slurm.submit import submit, write_job

__all__ = ["KINDS", "SlurmJob", "load_job", "render_job", "submit", "write_job"]
