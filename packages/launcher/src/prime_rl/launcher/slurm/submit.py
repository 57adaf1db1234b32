"""Write a job's files under ``<run_dir>`` and submit it with ``sbatch --parsable``."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from prime_rl.common.auth import SECRET_FILE_NAME, RunSecret
from prime_rl.common.config import write_toml
from prime_rl.launcher.slurm.job import SlurmJob
from prime_rl.launcher.slurm.render import render_job


@dataclass
class WrittenJob:
    script: Path
    """launcher/<kind>.sbatch"""
    submitted_config: Path
    """launcher/<kind>.toml: the whole config, ``<kind> @ launcher/<kind>.toml`` submits it again"""
    process_configs: dict[str, Path]
    """configs/<name>.toml, one per process kind"""


def write_job(job: SlurmJob, python: str | None = None) -> WrittenJob:
    """Render the script and write it with every resolved config (what ``--dry-run`` leaves behind)."""
    script_text = render_job(job, python)
    RunSecret.create(job.run_dir.root / SECRET_FILE_NAME)  # 0600, on the shared filesystem every node reads
    launcher_dir = job.run_dir.launcher_dir
    (launcher_dir / "logs").mkdir(parents=True, exist_ok=True)
    config = (
        job.config.model_copy(update={"dry_run": False}) if "dry_run" in type(job.config).model_fields else job.config
    )
    submitted = write_toml(config, launcher_dir / f"{job.kind}.toml")
    configs = {name: write_toml(cfg, job.run_dir.config_path(name)) for name, cfg in job.process_configs.items()}
    script = launcher_dir / f"{job.kind}.sbatch"
    script.write_text(script_text)
    script.chmod(0o755)
    return WrittenJob(script, submitted, configs)


class SubmitError(RuntimeError):
    """sbatch is missing or refused the job."""


def submit(script: Path, sbatch: str = "sbatch") -> str:
    """``sbatch --parsable script`` -> the job id (``12345`` or ``12345;cluster``)."""
    if shutil.which(sbatch) is None:
        raise SubmitError(
            f"{sbatch!r} is not on PATH: submit from a SLURM login node, or use --dry-run to only write {script}"
        )
    proc = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        raise SubmitError(
            f"sbatch {script} failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )
    job_id = proc.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SubmitError(f"sbatch {script} printed {proc.stdout.strip()!r}, not a job id")
    return job_id


def first_node(job_id: str, wait_s: float = 3.0) -> str | None:
    """The job's first host once it runs (placement puts inference node 0 there); None if still queued."""
    deadline = time.monotonic() + wait_s
    while True:
        proc = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True)
        nodelist = proc.stdout.strip() if proc.returncode == 0 else ""
        if nodelist and nodelist != "(null)":
            hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
            if hosts.returncode == 0 and hosts.stdout.split():
                return hosts.stdout.split()[0]
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.25)


def router_url(job_id: str, port: int) -> str:
    host = first_node(job_id)
    if host is None:
        return f"http://<first node of job {job_id}>:{port}/v1 (job still queued; `squeue -j {job_id} -o %N` names it)"
    return f"http://{host}:{port}/v1"
