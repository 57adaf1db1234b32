"""Render a job's sbatch script from its Jinja2 template.

Everything decidable at submit time is computed here (paths, ports, env vars, the Python that runs
every component) so that the templates hold only the job's shape. Placement (which host is which)
is left to the script itself, which reads the allocation with ``scontrol show hostnames``.

Every component's command line comes from ``prime_rl.common.commands`` (the one owner of the project's
argv), rendered into bash here: words known only inside the job (the node's rank, the head trainer node,
the replicas' addresses, the HTTP key) are ``ShellWord``s, written as they are; every other word is shell-quoted.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import jinja2

from prime_rl.common import commands
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


class ShellWord(str):
    """An argv word the job's shell expands (``"$i"``, ``"${CONTROL_ADDRS[@]}"``): written into the script as is."""


def shell_command(argv: list[str], indent: str = "    ", width: int = 110) -> str:
    """``argv`` as bash words (``ShellWord``s as they are, the rest shell-quoted), continued over lines of at
    most ``width`` characters where it can: a line breaks only before an option, which keeps its values."""
    units: list[str] = []  # the program, then each option with its values
    for word in (w if isinstance(w, ShellWord) else shlex.quote(w) for w in argv):
        if units and not word.startswith("-"):
            units[-1] += f" {word}"
        else:
            units.append(word)
    lines = [units[0]]
    for unit in units[1:]:
        if len(indent) + len(lines[-1]) + 1 + len(unit) > width:
            lines.append(unit)
        else:
            lines[-1] += f" {unit}"
    return (" \\\n" + indent).join(lines)


def component_commands(job: SlurmJob, python: str) -> dict[str, str]:
    """The bash command of every component the job's template starts, by name (``trainer``, ``inference``,
    ``router``, ``orchestrator``), from ``prime_rl.common.commands`` with the job's shell words."""
    # the transport table imports the wire format (msgspec, numpy): only a SLURM render needs it
    from prime_rl.common.weight_transports import TRANSPORTS

    configs = {name: str(job.run_dir.config_path(name).resolve()) for name in job.process_configs}
    control_addrs = [ShellWord('"${CONTROL_ADDRS[@]}"')]
    head = ShellWord('"$TRAIN_HEAD"')
    broadcast = job.extra.get("weight_broadcast")
    # who makes inference load each version: the orchestrator (filesystem) or the trainer (nccl, nixl, ipc)
    loads = TRANSPORTS[broadcast].loads if broadcast is not None else "orchestrator"
    # colocated: the orchestrator also puts every node's server to sleep after rollouts and wakes it (HandOver)
    orchestrator_controls = loads == "orchestrator" or job.colocated
    out: dict[str, str] = {}
    if "inference" in configs:
        pd = job.extra.get("pd")
        role = ShellWord('"$role"') if pd else None
        port, control = ShellWord('"$port"'), ShellWord('"$((port + 100))"')
        argv = commands.inference_node_command(python, configs["inference"], port, control, role)
        if job.colocated:  # vLLM's share beside the resting trainer, sized on the first node (slurm/colocated.py)
            argv.append(ShellWord('${VLLM_SHARE:+--vllm.gpu-memory-utilization "$VLLM_SHARE"}'))
        out["inference"] = shell_command(argv, indent="      ")
        # one router on the first inference node; its metrics on router_port + 1 (see SlurmConfig.router_port)
        workers = (
            [ShellWord('"${PREFILL_URLS[@]}"'), ShellWord('"${DECODE_URLS[@]}"')]
            if pd
            else [ShellWord('"${WORKER_URLS[@]}"')]
        )
        argv = commands.router_command(
            Path(python).parent / "vllm-router", workers, "0.0.0.0", job.slurm.router_port,
            "127.0.0.1", job.slurm.router_port + 1, disaggregated=bool(pd),
            kv_connector=pd["router_kv_connector"] if pd else None, api_key=ShellWord('"$VLLM_API_KEY"'),
            policy=job.extra.get("router_policy"),
        )  # fmt: skip
        out["router"] = shell_command(argv)
    if "orchestrator" in configs:
        argv = commands.orchestrator_node_command(
            python, configs["orchestrator"], ShellWord('"$ROUTER_URL"'), ShellWord('"$VLLM_API_KEY"'),
            [ShellWord('"${METRICS_URLS[@]}"')], job.process_configs["orchestrator"].num_train_ranks,
            control_addrs if orchestrator_controls else None,
        )  # fmt: skip
        out["orchestrator"] = shell_command(argv)
    if "trainer" in configs:
        if job.kind == "rl":
            module = commands.RL_TRAINER
            args = commands.rl_trainer_node_args(head, control_addrs if loads == "trainer" else None)
        else:
            module, args = commands.SFT_TRAINER, []
        argv = commands.torchrun_static_command(
            python, job.num_train_nodes, ShellWord('"$i"'), job.gpus_per_node,
            ShellWord(f'"$TRAIN_HEAD:{job.slurm.rdzv_port}"'), ShellWord('"$SLURM_JOB_ID"'), module,
            configs["trainer"], args,
        )  # fmt: skip
        out["trainer"] = shell_command(argv, indent="      ")
    return out


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
        "num_nodes": job.num_nodes,
        "num_train_nodes": num_train,
        "num_infer_nodes": num_infer,
        # colocated: the trainer's nodes are the inference nodes (each step sees every GPU the job has there)
        "colocated": job.colocated,
        "train_node_offset": 0 if job.colocated else num_infer,
        "gpus_per_node": job.gpus_per_node,
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
        "replica_port": job.slurm.replica_port,
        "router_policy": None,
        "replica_port_stride": 1,
        "weight_broadcast": None,
        "nixl_port": None,
        "launch_metadata_service": False,
        "ready_timeout_s": 1800,
        "restarts": None,  # rl with inference.max_restarts > 0: the budget and start-up deadline of a restart
        "pd": None,  # P/D-disaggregated inference: its shape (prime_rl.launcher.slurm.job._place_disaggregated)
        **job.extra,
        "commands": component_commands(job, python),
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
