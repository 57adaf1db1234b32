"""Where processes run: ``[deployment]`` (one node or many) and ``[slurm]`` (how many nodes are asked for)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from prime_rl.common.config.base import BaseConfig


class SingleNodeDeployment(BaseConfig):
    """All processes on this machine; GPUs from CUDA_VISIBLE_DEVICES, inference first, trainer next."""

    type: Literal["single_node"] = "single_node"
    num_train_gpus: int = Field(1, ge=1)
    """GPUs (or CPU processes on a machine without GPUs) for the trainer"""
    num_infer_gpus: int = Field(1, ge=0)
    """GPUs for inference (0 only when inference runs elsewhere)"""


class MultiNodeDeployment(BaseConfig):
    """Several nodes through SLURM: inference nodes first, trainer nodes next."""

    type: Literal["multi_node"] = "multi_node"
    num_train_nodes: int = Field(1, ge=1)
    """nodes for the trainer (torchrun multi-node rendezvous)"""
    num_infer_nodes: int = Field(1, ge=0)
    """nodes for inference, one vLLM replica per node behind a router on node 0"""
    gpus_per_node: int = Field(8, ge=1)
    """GPUs on each node"""


Deployment = Annotated[SingleNodeDeployment | MultiNodeDeployment, Field(discriminator="type")]


class SlurmConfig(BaseConfig):
    """Submit through sbatch instead of running locally."""

    job_name: str = "prime-rl"
    """SLURM job name"""
    partition: str | None = None
    """partition (-p); None leaves it to the cluster default"""
    account: str | None = None
    """account (-A)"""
    time: str | None = None
    """wall-clock limit, e.g. "24:00:00\""""
    template_path: Path | None = None
    """a Jinja2 sbatch template of your own; None uses the packaged one"""
    env_vars: dict[str, str] = {}
    """environment variables exported in the job (override the node-local cache dirs here)"""
    launch_modelexpress: bool = True
    """start a job-scoped weight-transfer metadata service on the trainer head node (nixl transport)"""
    install_command: str = "uv sync --all-extras --all-packages"
    """run once on the batch node before anything starts; skipped when the venv exists or PRIME_RL_SKIP_INSTALL=1"""
    rdzv_port: int = Field(29500, ge=1, le=65535)
    """torchrun rendezvous port on the head trainer node"""
    router_port: int = Field(8000, ge=1, le=65535)
    """port of the global router on the first inference node (the URL clients and the orchestrator use)"""
    replica_port: int = Field(8100, ge=1, le=65535)
    """HTTP port of the inference replica on inference node i is replica_port + i (distinct ports keep
    nodes that share one network, like a test cluster on one machine, apart)"""

    @model_validator(mode="after")
    def _template_exists(self) -> SlurmConfig:
        if self.template_path is not None and not Path(self.template_path).is_file():
            raise ValueError(f"template_path={str(self.template_path)!r} is not a file; give a Jinja2 sbatch template")
        return self
