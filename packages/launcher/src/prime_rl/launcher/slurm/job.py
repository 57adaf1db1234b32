"""Load a SLURM job: the component's config plus ``[deployment] type = "multi_node"`` and ``[slurm]``.

The component config classes (``SFTConfig``, ``InferenceConfig``, ``RLConfig``) are extended here
with the two job tables instead of requiring every class to carry them: the job config is the
component's own schema + ``deployment: MultiNodeDeployment`` + ``slurm: SlurmConfig``, parsed by the
common loader (so ``@ a.toml --slurm.job-name x`` and its one-line errors work as everywhere else).
Each process then gets the component's plain config with ``[slurm]`` removed and a single-node
``[deployment]``: what a rank runs never submits again.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Annotated, Any

import pydantic
from pydantic import BaseModel

from prime_rl.common.config import ConfigError, load_config
from prime_rl.common.config.base import MAX_PORT
from prime_rl.common.config.deployment import (
    ColocatedDeployment,
    DisaggregatedDeployment,
    MultiNodeDeployment,
    SlurmConfig,
    unknown_kv_connector,
)
from prime_rl.common.rundir import RunDir
from prime_rl.launcher.host_facts import HostFacts


@dataclass(frozen=True)
class Kind:
    """One SLURM entrypoint: its config class and the per-process configs it writes."""

    module: str
    class_name: str
    component: str
    """name of the per-process config under configs/ (configs/<component>.toml)"""
    places_trainer: bool
    places_inference: bool


KINDS: dict[str, Kind] = {
    "sft": Kind("prime_rl.common.config.trainer", "SFTConfig", "trainer", True, False),
    "inference": Kind("prime_rl.common.config.inference", "InferenceConfig", "inference", False, True),
    "rl": Kind("prime_rl.common.config.rl", "RLConfig", "rl", True, True),
}


@dataclass
class SlurmJob:
    """A resolved job: what to render and what to write before ``sbatch``."""

    kind: str
    config: BaseModel
    """the whole submitted config (component schema + deployment + slurm)"""
    deployment: MultiNodeDeployment | DisaggregatedDeployment | ColocatedDeployment
    slurm: SlurmConfig
    run_dir: RunDir
    process_configs: dict[str, BaseModel]
    """per-process configs by name (``trainer``, ``inference``, ``orchestrator``), no [slurm] in them"""
    extra: dict[str, Any]
    """kind-specific template values (e.g. the router policy)"""

    @property
    def colocated(self) -> bool:
        """``rl`` with ``[deployment] type = "colocated"``: each node runs its server and its trainer ranks."""
        return isinstance(self.deployment, ColocatedDeployment)

    @property
    def num_train_nodes(self) -> int:
        if not KINDS[self.kind].places_trainer:
            return 0
        return self.deployment.num_nodes if self.colocated else self.deployment.num_train_nodes

    @property
    def num_infer_nodes(self) -> int:
        if not KINDS[self.kind].places_inference:
            return 0
        pd = self.disaggregated
        if pd is not None:  # one node per P/D instance
            return pd.num_instances
        return self.deployment.num_nodes if self.colocated else self.deployment.num_infer_nodes

    @property
    def num_nodes(self) -> int:
        """Nodes the job asks for: inference nodes then trainer nodes, or (colocated) the nodes both share."""
        if self.colocated:
            return self.deployment.num_nodes
        return self.num_infer_nodes + self.num_train_nodes

    @property
    def gpus_per_node(self) -> int:
        """GPUs the job asks for on each node (colocated: the ones a node's server and trainer ranks share)."""
        return self.deployment.num_gpus if self.colocated else self.deployment.gpus_per_node

    @property
    def disaggregated(self) -> DisaggregatedDeployment | None:
        """The P/D deployment of the job's inference (``inference`` job: [deployment]; ``rl``: [inference.deployment])."""
        inference = self.process_configs.get("inference")
        deployment = getattr(inference, "deployment", None)
        return deployment if isinstance(deployment, DisaggregatedDeployment) else None


def component_class(kind: str) -> type[BaseModel]:
    if kind not in KINDS:
        raise ConfigError(f"unknown job kind {kind!r}; use one of {', '.join(KINDS)}")
    spec = KINDS[kind]
    try:
        module = importlib.import_module(spec.module)
    except ModuleNotFoundError as e:
        raise ConfigError(
            f"{kind}: its config schema {spec.module} is not installed ({e}); install prime-rl-common"
        ) from e
    return getattr(module, spec.class_name)


@cache
def job_class(cls: type[BaseModel]) -> type[BaseModel]:
    """``cls`` + ``deployment: MultiNodeDeployment`` (or the kinds below) + ``slurm: SlurmConfig`` (+ a run dir if
    it has none)."""
    # inference alone may also be P/D-disaggregated: one instance per node, prefill nodes first; rl colocated:
    # each node's server and trainer ranks on the same GPUs
    deployment: Any = MultiNodeDeployment
    if "deployment" in cls.model_fields and cls.__name__ == "InferenceConfig":
        deployment = Annotated[MultiNodeDeployment | DisaggregatedDeployment, pydantic.Field(discriminator="type")]
    elif cls.__name__ == "RLConfig":
        deployment = Annotated[MultiNodeDeployment | ColocatedDeployment, pydantic.Field(discriminator="type")]
    fields: dict[str, Any] = {
        "deployment": (deployment, MultiNodeDeployment()),
        "slurm": (SlurmConfig, ...),
    }
    if not hasattr(cls, "run_dir"):  # inference alone has no run directory; the job needs one
        fields["output_dir"] = (Path, Path("outputs"))
        fields["run_name"] = (str, cls.__name__.removesuffix("Config").lower())
    return pydantic.create_model(f"Slurm{cls.__name__}", __base__=cls, __doc__=cls.__doc__, **fields)


def process_config(cls: type[BaseModel], job_config: BaseModel) -> BaseModel:
    """The component's own config for one process: no [slurm], single-node [deployment], not a dry run."""
    data = job_config.model_dump(exclude={"slurm", "deployment"})
    data = {k: v for k, v in data.items() if k in cls.model_fields}
    if isinstance(job_config.deployment, DisaggregatedDeployment):  # each node runs one instance (--deployment.role)
        data["deployment"] = job_config.deployment.model_dump()
    elif "deployment" in cls.model_fields:
        data["deployment"] = {"type": "single_node"}
    if "dry_run" in cls.model_fields:
        data["dry_run"] = False
    try:
        return cls.model_validate(data)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise ConfigError(
            f"{key}: {first['msg']} (in the per-process {cls.__name__} derived from the job config)"
        ) from None


def _run_dir(config: BaseModel) -> RunDir:
    run = getattr(config, "run", None)  # rl: [run] name = ...
    run_name = run.name if run is not None else config.run_name
    try:
        return RunDir(config.output_dir, run_name)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def load_job(kind: str, argv: list[str], host: HostFacts | None = None) -> SlurmJob:
    """Resolve ``argv`` (``@ cfg.toml --key value``) into a job; raises ConfigError on bad input. ``host``: the
    facts an ``rl`` job is resolved with (default: this submit host's, ``gather_slurm``)."""
    cls = component_class(kind)
    config = load_config(job_class(cls), argv)
    if kind == "rl":  # resolved as a local run is (`prime_rl.launcher.resolution`), with this host's facts
        from prime_rl.launcher.slurm.rl_job import resolve_rl_job

        config, process_configs = resolve_rl_job(config, host)
    else:
        process_configs = {KINDS[kind].component: process_config(cls, config)}
    extra: dict[str, Any] = {}
    trainer = process_configs.get("trainer")
    if kind == "rl" and trainer is not None:
        extra["weight_broadcast"] = trainer.weight_broadcast.type
        if trainer.weight_broadcast.type == "nixl":
            extra["nixl_port"] = trainer.weight_broadcast.port
            extra["launch_metadata_service"] = config.slurm.launch_modelexpress
    inference = process_configs.get("inference")
    if inference is not None and hasattr(inference, "router"):
        extra["router_policy"] = inference.router.policy
        # A node serving several local replicas uses ports port..port+replicas: keep nodes apart.
        extra["replica_port_stride"] = inference.router.replicas + 1 if inference.router.replicas > 1 else 1
    if kind == "rl" and inference.max_restarts > 0:  # RLConfig refuses what a job cannot restart (P/D, ...)
        extra["restarts"] = {  # prime_rl.launcher.slurm.restarts
            "max_restarts": inference.max_restarts,
            "window_s": inference.restart_window,
            "startup_timeout_s": inference.router.startup_timeout,
        }
    job = SlurmJob(kind, config, config.deployment, config.slurm, _run_dir(config), process_configs, extra)
    if job.disaggregated is not None:
        _place_disaggregated(job)
    if KINDS[kind].places_inference and job.num_infer_nodes == 0:
        raise ConfigError(f"{kind}: deployment.num_infer_nodes=0 leaves inference nowhere to run; set it to >= 1")
    if KINDS[kind].places_inference and inference is not None and job.disaggregated is None:
        _check_replica_ports(job, inference, extra.get("replica_port_stride", 1))
    return job


def _check_replica_ports(job: SlurmJob, inference: Any, stride: int) -> None:
    """Inference node i serves on ``slurm.replica_port + i * stride`` and derives its control ports from that
    (``InferenceConfig``): the last node's must fit below 65536 before the job is submitted, not fail on the
    node once the job runs."""
    n = job.num_infer_nodes - 1
    last = job.slurm.replica_port + n * stride
    where = f"slurm.replica_port={job.slurm.replica_port} puts inference node {n} on port {last}"
    if last > MAX_PORT:
        raise ConfigError(f"{where}, above {MAX_PORT}; lower slurm.replica_port by at least {last - MAX_PORT}")
    node = inference.model_copy(update={"server": inference.server.model_copy(update={"port": last})})
    try:
        node.check_derived_ports()
    except ValueError as e:
        raise ConfigError(f"{where}, where {e} (lower slurm.replica_port by as much)") from None


def _place_disaggregated(job: SlurmJob) -> None:
    """Check a P/D job and give the template its shape: prefill nodes first, then decode nodes, one instance each."""
    pd = job.disaggregated
    key = "deployment" if job.kind == "inference" else "inference.deployment"
    if (error := unknown_kv_connector(pd, f"{key}.kv_connector")) is not None:
        raise ConfigError(error)
    if pd.role is not None:
        raise ConfigError(f"{key}.role={pd.role!r} is set by the job on each node; remove it")
    deployment = job.deployment
    if job.kind == "rl" and "num_infer_nodes" in deployment.model_fields_set:
        if deployment.num_infer_nodes != pd.num_instances:
            raise ConfigError(
                f"deployment.num_infer_nodes={deployment.num_infer_nodes} but inference.deployment places "
                f"{pd.num_prefill} prefill + {pd.num_decode} decode instances, one node each; set num_infer_nodes = "
                f"{pd.num_instances} or leave it out"
            )
    inference = job.process_configs["inference"]
    if pd.kv_connector == "ExampleConnector" and "shared_storage_path" not in pd.kv_connector_extra_config:
        # KV moves through files: a directory every node sees (the run dir is on the shared filesystem)
        # a new inference config, not an assignment into the validated one
        extra = {**pd.kv_connector_extra_config, "shared_storage_path": str(job.run_dir.root.resolve() / "kv_cache")}
        job.process_configs["inference"] = inference.model_copy(
            update={"deployment": pd.model_copy(update={"kv_connector_extra_config": extra})}
        )
    job.extra["pd"] = {
        "num_prefill": pd.num_prefill,
        "num_decode": pd.num_decode,
        "kv_connector": pd.kv_connector,
        # vllm-router's P/D handshake: NIXL's pull protocol for the NIXL connectors (its default otherwise too)
        "router_kv_connector": "mooncake" if pd.kv_connector.startswith("Mooncake") else "nixl",
        "nixl": pd.kv_connector.startswith("Nixl"),
        "side_channel_stride": inference.vllm.data_parallel_size,  # each DP engine listens on port + its rank
    }
