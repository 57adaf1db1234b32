"""Render a job's sbatch script from its Jinja2 template.

Everything decidable at submit time is computed here (paths, ports, env vars, the Python that runs
every component) so that the templates hold only the job's shape. Placement (which host is which)
is left to the script itself, which reads the allocation with ``scontrol show hostnames``.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import jinja2

from prime_rl.common.auth import SECRET_FILE_NAME
from prime_rl.common.env import SECRET_FILE_ENV, STALL_TIMEOUT_ENV
from prime_rl.launcher.slurm.job import KINDS, SlurmJob

TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "templates"

# Node-local compile / JIT caches (${UID} expands in the job): ranks sharing one cache on a
# network filesystem can crash or hang. slurm.env_vars overrides any of them.
DEFAULT_ENV_VARS = {
    "TRITON_CACHE_DIR": "/tmp/triton-${UID}",
    "VLLM_CACHE_ROOT": "/tmp/.vllm-cache-${UID}",
    "FLASHINFER_WORKSPACE_BASE": "/tmp/.flashinfer-cache-${UID}",
}


def project_dir() -> Path:
    """The checkout to run from: the uv workspace holding this package (editable install), else the cwd."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "packages" / "launcher" / "pyproject.toml").is_file() and (parent / "pyproject.toml").is_file():
            return parent
    return Path.cwd()


def _double_quoted(value: Any) -> str:
    """Escape for the inside of "..." in bash; ``$VAR`` still expands (``PATH = "/x/bin:${PATH}"``)."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`")


def watchdog_env(job: SlurmJob) -> dict[str, str]:
    """The default deadline of a heartbeat that names none: the run's ``stall_timeout`` (rl); sft has no such
    key and keeps the heartbeat's default unless ``slurm.env_vars`` sets PRIME_RL_STALL_TIMEOUT."""
    stall_timeout = getattr(job.config, "stall_timeout", None)
    return {} if stall_timeout is None else {STALL_TIMEOUT_ENV: str(stall_timeout)}


def job_context(job: SlurmJob, python: str | None = None) -> dict[str, Any]:
    python = python or sys.executable
    launcher_dir = job.run_dir.launcher_dir.resolve()
    num_train, num_infer = job.num_train_nodes, job.num_infer_nodes
    # Jobs that train are watched (heartbeats + watchdog); a standalone inference deployment is not: its
    # pauses are its operator's, and there is no run to stop.
    watched = KINDS[job.kind].places_trainer
    return {
        "kind": job.kind,
        "job_name": job.slurm.job_name,
        "partition": job.slurm.partition,
        "account": job.slurm.account,
        "time": job.slurm.time,
        "num_nodes": num_train + num_infer,
        "num_train_nodes": num_train,
        "num_infer_nodes": num_infer,
        "gpus_per_node": job.deployment.gpus_per_node,
        # the orchestrator sends per data-parallel group: the cp ranks of a group share one socket
        "train_cp": getattr(getattr(getattr(job.config, "trainer", None), "model", None), "cp", 1),
        "project_dir": str(project_dir()),
        "workdir": str(Path.cwd()),  # relative paths in the configs mean what they meant at submission
        "python": python,
        "bin_dir": str(Path(python).parent),
        "output_dir": str(job.run_dir.output_dir.resolve()),
        "run_name": job.run_dir.run_name,
        "run_dir": str(job.run_dir.root.resolve()),
        "launcher_dir": str(launcher_dir),
        "log_dir": str(launcher_dir / "logs"),
        "submitted_config": str(launcher_dir / f"{job.kind}.toml"),
        "configs": {name: str(job.run_dir.config_path(name).resolve()) for name in job.process_configs},
        "install_command": job.slurm.install_command,
        # Every process of the job authenticates its ZeroMQ sockets with the run secret (shared filesystem).
        "env_vars": {
            **DEFAULT_ENV_VARS,
            SECRET_FILE_ENV: str(job.run_dir.root.resolve() / SECRET_FILE_NAME),
            **(watchdog_env(job) if watched else {}),
            **job.slurm.env_vars,
        },
        # Every step's processes beat into <heartbeat_dir>/<step name>/; the job's watchdog reads them all.
        "heartbeat_dir": str(job.run_dir.root.resolve() / "heartbeats") if watched else None,
        "rdzv_port": job.slurm.rdzv_port,
        "router_port": job.slurm.router_port,
        "router_metrics_port": job.slurm.router_port + 1,  # see SlurmConfig.router_port
        "replica_port": job.slurm.replica_port,
        "router_command": shlex.quote(str(Path(python).parent / "vllm-router")),
        "router_policy": None,
        "replica_port_stride": 1,
        "weight_broadcast": None,
        "nixl_port": None,
        "launch_metadata_service": False,
        "ready_timeout_s": 1800,
        "pd": None,  # P/D-disaggregated inference: its shape (prime_rl.launcher.slurm.job._place_disaggregated)
        **job.extra,
    }


def template_environment() -> jinja2.Environment:
    """The packaged templates, with the ``q`` (shell-quote) and ``dq`` (inside "...") filters."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        # Jinja comments are {## ... ##}: bash's ${#array[@]} would open a default {# comment.
        comment_start_string="{##",
        comment_end_string="##}",
        undefined=jinja2.StrictUndefined,  # a typo in a template fails the render, not the job
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = lambda v: shlex.quote(str(v))
    env.filters["dq"] = _double_quoted
    return env


def render_job(job: SlurmJob, python: str | None = None) -> str:
    """The sbatch script: ``slurm.template_path`` if set, else the packaged ``<kind>.sbatch.j2``.

    A user template is compiled from its text, so ``{% extends "sft.sbatch.j2" %}`` always means the
    packaged one, even when the user's file has the same name.
    """
    env = template_environment()
    if job.slurm.template_path is not None:
        template = env.from_string(Path(job.slurm.template_path).read_text())
    else:
        template = env.get_template(f"{job.kind}.sbatch.j2")
    return template.render(**job_context(job, python))
