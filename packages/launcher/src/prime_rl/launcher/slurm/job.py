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
from typing import Any

import pydantic
from pydantic import BaseModel

from prime_rl.common.config import ConfigError, load_config
from prime_rl.common.config.deployment import MultiNodeDeployment, SlurmConfig
from prime_rl.common.rundir import RunDir


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
    deployment: MultiNodeDeployment
    slurm: SlurmConfig
    run_dir: RunDir
    process_configs: dict[str, BaseModel]
    """per-process configs by name (``trainer``, ``inference``, ``orchestrator``), no [slurm] in them"""
    extra: dict[str, Any]
    """kind-specific template values (e.g. the router policy)"""

    @property
    def num_train_nodes(self) -> int:
        return self.deployment.num_train_nodes if KINDS[self.kind].places_trainer else 0

    @property
    def num_infer_nodes(self) -> int:
        return self.deployment.num_infer_nodes if KINDS[self.kind].places_inference else 0


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
    """``cls`` + ``deployment: MultiNodeDeployment`` + ``slurm: SlurmConfig`` (+ a run dir if it has none)."""
    fields: dict[str, Any] = {
        "deployment": (MultiNodeDeployment, MultiNodeDeployment()),
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
    if "deployment" in cls.model_fields:
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


def load_job(kind: str, argv: list[str]) -> SlurmJob:
    """Resolve ``argv`` (``@ cfg.toml --key value``) into a job; raises ConfigError on bad input."""
    cls = component_class(kind)
    config = load_config(job_class(cls), argv)
    if kind == "rl":
        from prime_rl.launcher.slurm.rl_job import rl_process_configs

        process_configs = rl_process_configs(config)
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
    job = SlurmJob(kind, config, config.deployment, config.slurm, _run_dir(config), process_configs, extra)
    if KINDS[kind].places_inference and job.num_infer_nodes == 0:
        raise ConfigError(f"{kind}: deployment.num_infer_nodes=0 leaves inference nowhere to run; set it to >= 1")
    return job
