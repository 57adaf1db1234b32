"""The ``inference`` config: one vLLM server (or several replicas behind a router) with live weight updates.

``inference @ infer.toml --server.port 8001 --vllm.data-parallel-size 2``. In an ``rl`` config the same
schema sits under ``[inference]`` (``--inference.vllm.data-parallel-size 6``).

Design decisions:
- ``[vllm]`` is handed to vLLM verbatim: every key becomes the engine flag of the same name
  (``max_num_seqs = 64`` -> ``--max-num-seqs 64``), so any vLLM option works without a schema change.
  The options almost every deployment sets are typed fields of that same table (validated and shown in
  ``--help``); the rest are extra keys, in TOML or on the command line (``--vllm.max-num-seqs 64``).
- Logprobs are always those of the distribution sampled from (``logprobs_mode = "processed_logprobs"``:
  after temperature and any other processing). vLLM's default returns the raw model's, which the RL
  trainer (which divides its logits by the temperature) would compare against the wrong distribution;
  another value in ``[vllm]`` is refused.
- The HTTP API is vLLM's own OpenAI-compatible server; the control plane (pause / resume / load weights /
  broadcast / health) is a separate ZeroMQ endpoint speaking ``prime_rl.common.wire`` messages.
- Closed by default: both listen on loopback. The control endpoint authenticates with the run secret
  (``PRIME_RL_SECRET_FILE``, ``prime_rl.common.auth``) and refuses to bind another interface without
  one; the HTTP API on another interface needs ``server.api_key`` (vLLM's ``--api-key``: every call but
  /health, /ping and /metrics must carry ``Authorization: Bearer <key>``; ``prime_rl.inference.http_auth``).
- ``[router]`` with ``replicas > 1`` starts that many independent servers on this node behind one
  ``vllm-router`` endpoint (``server.port``); replica ``i`` serves HTTP on ``server.port + 1 + i`` and
  control on ``control_port + i``. Weight updates must be sent to every replica's control endpoint.
- ``[deployment] type = "disaggregated"`` splits prefill and decode onto separate instances (``num_prefill``,
  ``num_decode``) with a vLLM KV connector between them, behind ``vllm-router`` in P/D mode; the instances
  take the replicas' ports (prefill first). See ``prime_rl.common.config.deployment.DisaggregatedDeployment``.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from prime_rl.common.auth import is_loopback
from prime_rl.common.config.base import MAX_PORT, BaseConfig
from prime_rl.common.config.deployment import DisaggregatedDeployment, InferenceDeployment, LocalInferenceDeployment
from prime_rl.common.rundir import BROADCAST_MARKER
from prime_rl.common.vllm_compat import PROCESSED_LOGPROBS


class InferenceModelConfig(BaseConfig):
    """The model to serve."""

    name: str = "Qwen/Qwen3-0.6B"
    """Hugging Face id or local directory of the model (config, tokenizer, safetensors)."""
    served_name: str | None = None
    """Model name clients send in requests; None uses ``name``."""


INFERENCE_PORT_HEADROOM = 200
"""Ports an inference deployment may derive above ``server.port`` at default settings: the control ports at
+100 (one per instance), the router's metrics port and the NIXL side channel after them (tests pick a
``server.port`` with this much room: ``free_port(headroom=INFERENCE_PORT_HEADROOM)``)."""


class ServerConfig(BaseConfig):
    """Where the HTTP API and the control plane listen."""

    host: str = "127.0.0.1"
    """Interface of the OpenAI-compatible HTTP API (and of the router, with replicas); another than loopback needs api_key."""
    port: int = Field(8000, ge=1, le=MAX_PORT)
    """Port of the OpenAI-compatible HTTP API (and of the router, with replicas)."""
    control_host: str = "127.0.0.1"
    """Interface the ZeroMQ control endpoint binds on; another than loopback needs the run secret (PRIME_RL_SECRET_FILE)."""
    control_port: int | None = Field(None, ge=1, le=MAX_PORT)
    """Port of the ZeroMQ control endpoint; None means ``port + 100``."""

    api_key: str | None = None
    """Bearer token every HTTP request but /health, /ping, /metrics must carry; required when host is not loopback."""

    @model_validator(mode="after")
    def _open_http_needs_a_key(self) -> ServerConfig:
        # vLLM also takes the key from VLLM_API_KEY (how SLURM jobs pass it, out of `ps` output).
        if self.api_key is None and not os.environ.get("VLLM_API_KEY") and not is_loopback(self.host):
            raise ValueError(
                f"server.host={self.host!r} exposes the HTTP API beyond this machine without authentication; "
                "set server.api_key (clients send it as a Bearer token), or bind 127.0.0.1"
            )
        return self

    @property
    def resolved_control_port(self) -> int:
        return self.control_port if self.control_port is not None else self.port + 100


class VLLMConfig(BaseConfig):
    """Engine options passed to vLLM verbatim (key ``max_num_seqs`` -> flag ``--max-num-seqs``)."""

    # Extra keys are the point of this table: anything vLLM's engine accepts.
    model_config = ConfigDict(extra="allow", validate_default=True)

    data_parallel_size: int = Field(1, ge=1)
    """Data-parallel engines inside this server (vLLM balances requests across them)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs each engine shards the model over."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest prompt + completion in tokens; None uses the model's own limit."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Fraction of each GPU's memory vLLM may take (weights + KV cache)."""
    dtype: str = "auto"
    """Weight / activation dtype ("auto" keeps the checkpoint's; "bfloat16", "float32" ...)."""
    enforce_eager: bool = False
    """Skip CUDA-graph capture / compilation (faster start, slower decode; needed on CPU tests)."""
    logprobs_mode: str = PROCESSED_LOGPROBS
    """Always "processed_logprobs": returned logprobs are those of the distribution sampled from (RL needs them)."""

    @field_validator("logprobs_mode")
    @classmethod
    def _processed_logprobs_only(cls, value: str) -> str:
        if value != PROCESSED_LOGPROBS:
            raise ValueError(
                f"logprobs_mode={value!r}: RL compares the trainer's logprobs with those of the distribution "
                f"vLLM sampled from (after temperature), which only {PROCESSED_LOGPROBS!r} returns; remove the key"
            )
        return value

    def engine_args(self) -> dict[str, Any]:
        """Every option, typed and extra, as ``{snake_case_name: value}``."""
        return {**{name: getattr(self, name) for name in type(self).model_fields}, **(self.model_extra or {})}


class WeightUpdateConfig(BaseConfig):
    """How the server applies weight updates sent to its control endpoint."""

    pause_mode: Literal["keep", "wait", "abort"] = "keep"
    """In-flight requests during an update the client did not pause for: frozen ("keep"), finished ("wait") or aborted."""
    marker: str = BROADCAST_MARKER
    """File a checkpoint directory must contain before it is loaded (written last by the trainer)."""
    broadcast_timeout: float = Field(600.0, gt=0)
    """Seconds a worker waits for the trainer while joining the broadcast group or receiving a bucket."""
    max_pause: float = Field(600.0, gt=0)
    """Seconds a client may keep generation paused; longer, and the run's watchdog stops the run naming the pauser."""
    verify_data: bool = True
    """Read every byte of a filesystem update (sizes, the trainer's checksums, no NaN/Inf) before the engine loads it."""


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks vLLM's --max-lora-rank accepts."""


class InferenceLoRAConfig(BaseConfig):
    """Serve LoRA adapters over the one base model (vLLM --enable-lora). Clients pick one by name
    (`"model": "<adapter>"`); the base stays servable under its own name. Adapters published by a LoRA RL
    trainer (`broadcasts/step_<n>/` in peft format) are loaded, or replaced in place, by name through the control
    plane, like full weights; other adapters can be listed here to serve from the start."""

    max_rank: int = 16
    """Largest adapter rank served (vLLM --max-lora-rank: one of 1, 8, 16, 32, 64, 128, 256, 320, 512)."""
    max_loras: int = Field(1, ge=1)
    """Adapters that can be in one batch at once (vLLM --max-loras); more than that wait for a slot."""
    adapters: dict[str, str] = {}
    """Adapters served from the start, name -> peft adapter directory (vLLM --lora-modules name=path)."""
    placeholders: list[str] = []
    """Adapter names served as the base model (a zero adapter) until a trainer publishes their first version:
    a LoRA RL policy's name at step 0 (`rl` adds the trainer's adapter name)."""

    @field_validator("max_rank")
    @classmethod
    def _vllm_rank(cls, value: int) -> int:
        if value not in LORA_RANKS:
            bigger = [r for r in LORA_RANKS if r >= value]
            raise ValueError(
                f"lora.max_rank={value} is not a rank vLLM allocates for; use one of {LORA_RANKS}"
                + (f" (e.g. {bigger[0]})" if bigger else "")
            )
        return value


class RouterConfig(BaseConfig):
    """Independent replicas of the server on this node behind one vllm-router endpoint."""

    replicas: int = Field(1, ge=1)
    """Number of independent servers; 1 serves directly on ``server.port`` with no router."""
    policy: Literal[
        "consistent_hash", "sticky_least_loaded", "cache_aware", "round_robin", "power_of_two", "random"
    ] = "consistent_hash"
    """vllm-router policy; consistent_hash / sticky_least_loaded keep one ``x-session-id`` header on one replica."""
    metrics_port: int | None = Field(None, ge=1, le=MAX_PORT)
    """Port of the router's Prometheus metrics; None means the port after the replicas' control ports."""
    startup_timeout: float = Field(900.0, gt=0)
    """Seconds to wait for every replica to serve before the router starts (and the run fails)."""


class InferenceConfig(BaseConfig):
    """A vLLM server with live weight updates; ``inference @ infer.toml``."""

    model: InferenceModelConfig = InferenceModelConfig()
    """The served model."""
    server: ServerConfig = ServerConfig()
    """HTTP and control endpoints."""
    vllm: VLLMConfig = VLLMConfig()
    """vLLM engine options, passed verbatim."""
    weights: WeightUpdateConfig = WeightUpdateConfig()
    """Weight-update behaviour."""
    router: RouterConfig = RouterConfig()
    """Replicas and the router in front of them."""
    env_vars: dict[str, str] = {}
    """Environment variables set before vLLM starts (e.g. VLLM_CPU_KVCACHE_SPACE)."""
    lora: InferenceLoRAConfig | None = None
    """Serve LoRA adapters (`[lora]`, needed by LoRA RL); None serves the base model only."""
    deployment: InferenceDeployment = LocalInferenceDeployment()
    """single_node (one server, or [router] replicas), or disaggregated (prefill and decode instances)."""
    max_restarts: int = Field(0, ge=0)
    """`rl` only: times the launcher restarts a dead inference server within `restart_window` (the orchestrator
    waits, then reloads the current policy); 0 stops the run naming the dead server."""
    restart_window: float = Field(3600.0, gt=0)
    """Seconds over which `max_restarts` is counted: a restart older than this no longer counts."""

    @property
    def disaggregated(self) -> DisaggregatedDeployment | None:
        return self.deployment if isinstance(self.deployment, DisaggregatedDeployment) else None

    @property
    def num_instances(self) -> int:
        """vLLM servers this config starts, each with its own control endpoint (``control_port + i``)."""
        pd = self.disaggregated
        if pd is not None:
            return 1 if pd.role is not None else pd.num_instances
        return self.router.replicas

    @property
    def instance_http_ports(self) -> list[int]:
        """HTTP port of each instance when a router fronts them (``fronted_by_router``): ``server.port + 1 + i``."""
        return [self.server.port + 1 + i for i in range(self.num_instances)]

    @property
    def instance_control_ports(self) -> list[int]:
        """Control port of each instance (of the one server, when it serves alone): ``control_port + i``."""
        control = self.server.resolved_control_port
        return [control + i for i in range(self.num_instances)]

    @property
    def fronted_by_router(self) -> bool:
        """True when this process starts instances and a router instead of serving itself."""
        pd = self.disaggregated
        return pd.role is None if pd is not None else self.router.replicas > 1

    @model_validator(mode="before")
    @classmethod
    def _multi_node_goes_through_slurm(cls, data: Any) -> Any:
        deployment = data.get("deployment") if isinstance(data, dict) else None
        # (the SLURM job's schema, a subclass from prime_rl.launcher.slurm.job, takes multi_node itself)
        if cls is InferenceConfig and isinstance(deployment, dict) and deployment.get("type") == "multi_node":
            raise ValueError(
                "deployment.type='multi_node' runs inference through SLURM: add a [slurm] table (one replica per "
                "node), or use single_node / disaggregated on this machine"
            )
        return data

    @model_validator(mode="after")
    def _disaggregated_alone(self) -> InferenceConfig:
        pd = self.disaggregated
        if pd is None:
            return self
        if self.router.replicas > 1:
            raise ValueError(
                f"router.replicas={self.router.replicas} with deployment.type='disaggregated': a P/D deployment "
                "sizes itself with deployment.num_prefill and deployment.num_decode; remove router.replicas"
            )
        if (self.vllm.model_extra or {}).get("kv_transfer_config") is not None:
            raise ValueError(
                "[vllm] kv_transfer_config with deployment.type='disaggregated': the KV connector of each role is "
                "built from [deployment] (kv_connector, kv_buffer_device, kv_connector_extra_config); remove it"
            )
        if self.lora is not None:
            raise ValueError(
                "[lora] with deployment.type='disaggregated' is not supported (KV connectors and LoRA adapters "
                "are untested together here); remove [lora] or use deployment.type='single_node'"
            )
        return self

    @model_validator(mode="after")
    def _derived_ports_fit(self) -> InferenceConfig:
        # Checked here, at start-up, not by the replica that is handed the port: a server.port near 65535 made
        # each replica fail its own --server.control-port check after the run had started (CI, issue 29).
        self.check_derived_ports()
        return self

    def check_derived_ports(self) -> None:
        """Raise ValueError, naming the port and the fix, when a port derived from ``server.port`` passes 65535
        (also asked by the SLURM job for its last node's port, which only the node's own config is given)."""
        derived = {"the control port" + ("s" if self.num_instances > 1 else ""): max(self.instance_control_ports)}
        if self.fronted_by_router:
            derived["the replicas' HTTP ports"] = max(self.instance_http_ports)
            if self.router.metrics_port is None:
                derived["the router's metrics port"] = self.server.resolved_control_port + self.num_instances
        for what, port in derived.items():
            if port > MAX_PORT:
                room = port - MAX_PORT
                raise ValueError(
                    f"server.port={self.server.port} (server.control_port={self.server.control_port}) puts {what} "
                    f"at {port}, above {MAX_PORT}; lower server.port (or server.control_port) by at least {room}"
                )

    @model_validator(mode="after")
    def _ports_do_not_collide(self) -> InferenceConfig:
        control = self.server.resolved_control_port
        http_ports = {self.server.port} | (set(self.instance_http_ports) if self.fronted_by_router else set())
        control_ports = set(self.instance_control_ports)
        if http_ports & control_ports:
            raise ValueError(
                f"server.control_port={control} collides with the HTTP port(s) {sorted(http_ports)}; "
                f"set server.control_port outside {min(http_ports)}..{max(http_ports)}"
            )
        return self
