"""Resolving a run: the validated `RLConfig` plus the machine's facts -> the configs each process is given.

`resolve` is the one place that fills what depends on the machine (internal ports, the published weights'
dtype, the resume step, a multi-node trainer's data-parallel groups) and checks what only a placement can refuse. It is pure: the same config and
`HostFacts` give equal results, the input config is left as it was, and the result is frozen. Both launchers
call it (`rl` on one node, the SLURM job renderer) and write what it returns, so a local run and a SLURM job
of one config and one set of facts are given the same per-process configs.

No validated model is assigned to: the resolved config is rebuilt (`prime_rl.common.config.rebuild.updated`)
over a deep copy, so nothing it returns shares a mutable object with the input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from prime_rl.common.config import ConfigError
from prime_rl.common.config.deployment import MultiNodeDeployment
from prime_rl.common.config.inference import InferenceConfig
from prime_rl.common.config.orchestrator import OrchestratorConfig
from prime_rl.common.config.rebuild import updated
from prime_rl.common.config.rl import RLConfig, train_groups
from prime_rl.common.config.rl_trainer import RLTrainerConfig
from prime_rl.launcher.colocate import colocated_changes
from prime_rl.launcher.host_facts import HostFacts


@dataclass(frozen=True)
class ResolvedRun:
    """A resolved run: the whole config (written as configs/rl.toml) and the per-process configs within it."""

    config: RLConfig
    resume_step: int | str | None
    """The step trainer and orchestrator resume from (as configured when the host did not resolve it)."""

    @property
    def trainer(self) -> RLTrainerConfig:
        return self.config.trainer

    @property
    def orchestrator(self) -> OrchestratorConfig:
        return self.config.orchestrator

    @property
    def inference(self) -> InferenceConfig:
        return self.config.inference

    def process_configs(self) -> dict[str, BaseModel]:
        """``{"trainer", "orchestrator", "inference"}``: what each process is started with."""
        return {"trainer": self.trainer, "orchestrator": self.orchestrator, "inference": self.inference}


def _check_multi_node(cfg: RLConfig) -> None:
    """What only a multi-node placement can refuse: `dp_replicate` must divide the trainer's ranks
    (a single-node run's RLConfig refuses it against num_train_gpus)."""
    deployment, dp_replicate = cfg.deployment, cfg.trainer.model.dp_replicate
    if not isinstance(deployment, MultiNodeDeployment) or dp_replicate <= 1:
        return
    if (deployment.num_train_nodes * deployment.gpus_per_node) % dp_replicate:
        raise ConfigError(
            f"trainer.model.dp_replicate={dp_replicate} must divide the trainer's "
            f"{deployment.num_train_nodes} nodes x {deployment.gpus_per_node} GPUs"
        )


def _multi_node_changes(cfg: RLConfig) -> dict[str, Any]:
    """What a multi-node placement derives (a single-node run's RLConfig derives it from num_train_gpus): the
    orchestrator's data-parallel groups over every trainer node's GPUs."""
    deployment = cfg.deployment
    if not isinstance(deployment, MultiNodeDeployment):
        return {}
    ranks = deployment.num_train_nodes * deployment.gpus_per_node
    return {"orchestrator.num_train_ranks": train_groups(ranks, cfg.trainer.model.cp)}


def _port_changes(cfg: RLConfig, host: HostFacts) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    if host.batch_port is not None:  # the trainer pulls where the orchestrator pushes
        changes["orchestrator.trainer.port"] = host.batch_port
        changes["trainer.data.port"] = host.batch_port
    if host.broadcast_port is not None:
        changes["trainer.weight_broadcast.port"] = host.broadcast_port
    if host.weights_port is not None:
        changes["orchestrator.trainer.weights_port"] = host.weights_port
        wb = cfg.trainer.weight_broadcast
        if wb.announce == f"tcp://127.0.0.1:{cfg.orchestrator.trainer.weights_port}":  # derived by RLConfig: follow
            changes["trainer.weight_broadcast.announce"] = f"tcp://127.0.0.1:{host.weights_port}"
    return changes


def _dtype_changes(cfg: RLConfig, host: HostFacts) -> dict[str, Any]:
    """Published weights must be in the dtype inference serves (every transport's receiver refuses others).
    `rl` on one node keeps a dtype the config names (vLLM's "auto" may serve another than config.json says).
    A SLURM job's config is the hand-off of `rl` (configs/rl.toml: every default written out), where a named
    dtype cannot be told from a written default, so the served one always wins there (an fp32 server refused
    every update of a default bfloat16, seen in tests/slurm)."""
    wb = cfg.trainer.weight_broadcast
    if host.served_dtype is None or ("dtype" in wb.model_fields_set and cfg.slurm is None):
        return {}
    return {"trainer.weight_broadcast.dtype": host.served_dtype}


def resolve(cfg: RLConfig, host: HostFacts) -> ResolvedRun:
    """The run ``cfg`` resolved on a machine with ``host``'s facts; ``cfg`` is left unchanged.

    Raises ConfigError for what only the placement refuses (multi-node `dp_replicate`)."""
    _check_multi_node(cfg)
    changes = {
        **_multi_node_changes(cfg),
        **_port_changes(cfg, host),
        **_dtype_changes(cfg, host),
        **colocated_changes(cfg, host.gpu_bytes, host.num_params),
    }
    resume_step = cfg.trainer.ckpt.resume_step
    if host.resume_resolved:  # one step for both: written into both configs
        resume_step = host.resume_step
        changes["trainer.ckpt.resume_step"] = resume_step
        changes["orchestrator.ckpt.resume_step"] = resume_step
    return ResolvedRun(updated(cfg.model_copy(deep=True), changes), resume_step)
