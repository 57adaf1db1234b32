"""What resolving a run needs to know about the machine it is resolved on, gathered in one impure step.

`prime_rl.launcher.resolution.resolve` is pure: it takes the validated `RLConfig` and a `HostFacts` and
returns the per-process configs. Everything that reads the disk or takes a lock happens here instead, once:
the internal ports reserved for the run, the dtype inference serves (the checkpoint's config.json), and the
step a resume starts from (the run directory's complete checkpoints).

Two gatherers, one per launcher: `gather_local` for `rl` on this node (reserves ports, resolves the resume
step), `gather_slurm` for the submit host of a SLURM job (neither: the job's nodes bind its ports and read
its checkpoints, and the model may not even be visible here).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from prime_rl.common.config import ConfigError
from prime_rl.common.config.rl import RLConfig
from prime_rl.common.net import PortLease, reserve_ports
from prime_rl.common.rundir import RunDir

_VLLM_DTYPE_NAMES = {"half": "float16", "float": "float32"}
"""vLLM's aliases for `--dtype`, as the torch dtype names the weight transports use."""


@dataclass(frozen=True)
class HostFacts:
    """Machine facts a run's resolution depends on; None leaves the config's own value."""

    served_dtype: str | None = None
    """Dtype inference serves the model in (`inference.vllm.dtype`, or the checkpoint's for "auto"); None when
    the model's config.json is not readable here."""
    batch_port: int | None = None
    """First of the orchestrator's batch ports (one per trainer rank), reserved because the config set none."""
    broadcast_port: int | None = None
    """The NCCL / NIXL broadcast group's port, reserved because the config set none."""
    weights_port: int | None = None
    """The orchestrator's version-announcement port, reserved because the config set none."""
    resume_resolved: bool = False
    """Whether `resume_step` was resolved against the run directory (`rl` on this node); a SLURM job's
    components resolve their own."""
    resume_step: int | None = None
    """The step both trainer and orchestrator resume from (None: a fresh start), when `resume_resolved`."""
    gpu_bytes: int | None = None
    """Memory of one of the run's GPUs (colocated runs size vLLM's share with it); None without GPUs."""
    num_params: int | None = None
    """Parameters of the model's checkpoint (colocated runs); None when not read."""


def read_served_dtype(cfg: RLConfig) -> str | None:
    """The dtype inference serves in, which published weights must match ("auto" = the checkpoint's); None
    when "auto" and the model's config.json is not here (a SLURM submit host need not see the model)."""
    dtype = cfg.inference.vllm.dtype
    if dtype != "auto":
        return _VLLM_DTYPE_NAMES.get(dtype, dtype)
    config_path = Path(cfg.trainer.model.name) / "config.json"
    if not config_path.is_file():
        return None
    hf = json.loads(config_path.read_text())
    return str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16")


def shared_resume_step(cfg: RLConfig) -> int | str | None:
    """The one resume step trainer and orchestrator ask for; refuses two different ones (one-line ConfigError).

    Each component resolving "latest" on its own resumed them at different steps after a kill between their
    checkpoints; the launcher resolves it once and writes it into both configs instead."""
    trainer_step, orchestrator_step = cfg.trainer.ckpt.resume_step, cfg.orchestrator.ckpt.resume_step
    if trainer_step != orchestrator_step:
        raise ConfigError(
            f"trainer.ckpt.resume_step={trainer_step!r} and orchestrator.ckpt.resume_step={orchestrator_step!r} "
            "differ, so trainer and orchestrator would continue from different steps; set [ckpt] resume_step "
            "(it sets both)",
            keys=["trainer.ckpt.resume_step", "orchestrator.ckpt.resume_step"],
        )
    return trainer_step


_LEASES: list[PortLease] = []  # held for the launcher's lifetime: a closed lease frees its ports


def _reserve(count: int, key: str) -> int:
    lease = reserve_ports(count, key)
    _LEASES.append(lease)
    return lease.base


def gather_local(cfg: RLConfig, run_dir: RunDir) -> HostFacts:
    """The facts of an `rl` run on this node: reserves the internal ports nobody set and resolves the resume step.

    Internal ports are reserved, not merely seen free: taken above the ephemeral range (the kernel never hands
    them to an outgoing connection) and locked for this process's lifetime, so a second launcher started the
    same second picks others (`prime_rl.common.net.reserve_ports`). Reserved in a fixed order (batch,
    broadcast, announcements): the same run directory gets the same ports when they are free.
    Raises ConfigError (resume steps differ) or FileNotFoundError (a resume step not complete for both)."""
    key = str(Path(cfg.output_dir).resolve() / cfg.run.name)
    endpoint, wb = cfg.orchestrator.trainer, cfg.trainer.weight_broadcast
    batch_port = broadcast_port = weights_port = None
    if "port" not in endpoint.model_fields_set:
        batch_port = _reserve(cfg.deployment.num_train_gpus, key)  # one socket per rank
    if wb.type in ("nccl", "nixl", "ipc") and "port" not in wb.model_fields_set:
        broadcast_port = _reserve(1, key)
    if "weights_port" not in endpoint.model_fields_set:  # the trainer's version announcements
        weights_port = _reserve(1, key)
    served = read_served_dtype(cfg)
    resume_step = run_dir.resolve_resume_step(shared_resume_step(cfg))
    return HostFacts(served, batch_port, broadcast_port, weights_port, resume_resolved=True, resume_step=resume_step)


def gather_slurm(cfg: RLConfig) -> HostFacts:
    """The facts of a SLURM job's submit host: the served dtype, when the model is visible here; no ports
    (the job's nodes bind the configured ones) and no resume step (each component resolves its own)."""
    return HostFacts(served_dtype=read_served_dtype(cfg))
