"""Orchestrator config: `orchestrator @ orch.toml --model.client.base-url http://host:8000/v1`.

Names follow the user docs (`orchestrator.model.client.base_url`, `batch_size`, `group_size`,
`seq_len`, `max_off_policy_steps`, ...). Importable without torch: the launcher validates it.

Trainer rank r pulls its batches from `tcp://<trainer.address>:<trainer.port + r>` (the orchestrator
binds one ZeroMQ PUSH socket per rank), matching the RL trainer's `data.host` / `data.port`.

Steps and versions: batch `step` (0-based) is trained by trainer step `step`, starting from policy
version `step` (= weights after `step` optimizer updates). After that update the trainer publishes
version `step + 1` (filesystem: under `<run_dir>/broadcasts/step_<step + 1>/`, renamed into place
when complete) and announces it on `trainer.weights_port`.
A rollout sampled with version `v` is `step - v` steps off-policy in batch `step`; more than `max_off_policy_steps` and it is dropped.
Everything a user sees counts completed optimizer steps: batch `step` is row `step + 1` in metrics.jsonl
(trainer and orchestrator alike), and its checkpoints are `checkpoints/step_<step + 1>/`.

Sampling (`[sampling]`) is sent in full with every request, so a checkpoint's generation_config.json
(Qwen's sets top_k, top_p, ...) never changes what is sampled. The trainer recomputes logprobs as
log_softmax(logits / temperature): settings that reshape the distribution otherwise (top_p, top_k,
min_p, penalties) make its logprobs differ from the sampler's, so they are refused unless
`sampling.allow_unmodeled = true`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from prime_rl.common.config.base import MAX_PORT, BaseConfig
from prime_rl.common.config.monitor import MonitorConfig
from prime_rl.common.config.run_section import RunSectionConfig


class ClientConfig(BaseConfig):
    """How to reach the OpenAI-compatible inference API."""

    base_url: str = "http://localhost:8000/v1"
    """Base URL of the OpenAI-compatible API (a vLLM server or a router in front of several)."""
    api_key: str = "EMPTY"
    """Bearer token sent with every request (vLLM ignores it unless started with --api-key)."""
    timeout: float = Field(default=1800.0, gt=0)
    """Seconds one generation request may take before it is retried."""
    max_retries: int = Field(default=6, ge=0)
    """Retries of a request that failed to connect, timed out or got a 5xx, before the run stops."""
    retry_backoff: float = Field(default=0.5, gt=0)
    """Seconds before the first retry; doubled after each failed attempt."""
    max_backoff: float = Field(default=10.0, gt=0)
    """Upper bound on the wait between two retries, in seconds."""
    api: Literal["auto", "chat", "samples"] = "auto"
    """How single-turn rollouts are asked for. "chat": vLLM's `/v1/chat/completions` (any OpenAI-compatible
    server or router). "samples": the prompt is rendered by the server's `/tokenize`, then generated through
    prime-rl's samples route, which returns token ids and logprobs as arrays instead of a JSON entry per token
    (colocated `rl` on an H100: rollouts 1.49x faster than "chat", benchmarks/results/rl_system.md). Needs a
    prime-rl inference server (not a router in front of several: it would reach one of them) and no routed
    experts. "auto": "samples" when the client talks to one server (`metrics_urls` lists at most one) and no
    routed experts are asked for, else "chat"; a server without the samples route (a plain vLLM) answers its
    first request with 404, and the client then uses "chat" for the rest of the run (logged once)."""
    metrics_urls: list[str] = Field(default_factory=list)
    """Root URL (http://host:port) of every inference server behind a router: rollout concurrency follows the sum
    of their vLLM `/metrics` (vllm-router answers /metrics with one replica's). Empty: the server at `base_url`.
    `rl` sets it for its replicas and P/D instances, locally and on SLURM."""


class ClientModelConfig(BaseConfig):
    """The served model and how to talk to it."""

    name: str = "Qwen/Qwen3-0.6B"
    """Model name sent in each request (vLLM's --served-model-name, usually the HF id or path)."""
    client: ClientConfig = ClientConfig()
    """The inference API endpoint."""
    chat_template: str | None = None
    """Jinja chat template sent with each request; None uses the model's own template."""
    tool_call_parser: Literal["hermes", "glm45"] = "hermes"
    """How the model writes tool calls (vLLM parser name); multi-turn rollouts parse them in the orchestrator.
    In `rl`, `[inference.vllm] tool_call_parser` (vLLM's chat-API parser) sets it too, when it is one of these."""


class EnvBaseConfig(BaseConfig):
    """What every `[[orchestrator.env]]` entry has besides its own settings."""

    name: str | None = None
    """Name in metrics (`env/<name>/...`) and eval outputs; None = the type (unique names are required)."""
    weight: float = Field(default=1.0, gt=0)
    """Share of the rollout groups drawn from this environment (weights are normalized over all entries)."""
    workers: int = Field(default=1, ge=0)
    """Worker processes running this environment (talked to over ZeroMQ); 0 = threads in the orchestrator."""
    timeout: float = Field(default=60.0, gt=0)
    """Seconds one rollout may spend in the environment (prompt, replies, scoring); past it the rollout
    fails (counted as env/<name>/timeouts) and a worker process is restarted."""

    @property
    def resolved_name(self) -> str:
        return self.name or self.type  # type: ignore[attr-defined]


class ReverseTextEnvConfig(EnvBaseConfig):
    """Reverse a short random string; reward 1 - normalized edit distance (dense, learnable)."""

    type: Literal["reverse_text"] = "reverse_text"
    """Environment kind."""
    unit: Literal["chars", "words"] = "chars"
    """Reverse the letters of one word, or the order of several words."""
    min_len: int = Field(default=3, ge=1)
    """Fewest letters (chars) or words (words) in a task."""
    max_len: int = Field(default=8, ge=1)
    """Most letters (chars) or words (words) in a task."""


class ArithmeticEnvConfig(EnvBaseConfig):
    """Small integer sums; reward 1 for the exact answer, else 0."""

    type: Literal["arithmetic"] = "arithmetic"
    """Environment kind."""
    num_terms: int = Field(default=2, ge=2)
    """Numbers added in each task."""
    max_value: int = Field(default=99, ge=1)
    """Largest term (terms are drawn from 0..max_value)."""


class ReasoningGymEnvConfig(EnvBaseConfig):
    """A procedural task from the `reasoning-gym` package (pip install reasoning-gym); no downloads."""

    type: Literal["reasoning_gym"] = "reasoning_gym"
    """Environment kind."""
    name: str = "basic_arithmetic"
    """reasoning-gym dataset name, e.g. basic_arithmetic, leg_counting, spell_backward."""
    size: int = Field(default=10_000, ge=1)
    """Number of procedurally generated entries to sample from."""
    seed: int = 0
    """Seed of the generator (task sampling uses the orchestrator's seed)."""
    kwargs: dict[str, int | float | str | bool] = {}
    """Extra keyword arguments for reasoning_gym.create_dataset."""


class ToolArithmeticEnvConfig(EnvBaseConfig):
    """Multi-turn tool use: call the `add` (or `multiply`) tool, read its result, reply with the number."""

    type: Literal["tool_arithmetic"] = "tool_arithmetic"
    """Environment kind."""
    max_value: int = Field(default=99, ge=1)
    """Largest operand (operands are drawn from 0..max_value)."""
    ops: list[Literal["add", "multiply"]] = Field(default=["add"], min_length=1)
    """Operations drawn from; each has its own tool."""
    max_turns: int = Field(default=3, ge=2)
    """Most assistant turns per rollout (a call, then the answer: 2)."""


class PythonEnvConfig(EnvBaseConfig):
    """Your own environment: an `Environment` subclass (or a function returning one) importable as `module:attr`."""

    type: Literal["python"] = "python"
    """Environment kind."""
    entrypoint: str = Field(pattern=r"^[\w.]+:[\w.]+$")
    """`package.module:ClassOrFactory`, importable in the orchestrator's Python environment."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments it is called with."""


class VerifiersEnvConfig(EnvBaseConfig):
    """An installed verifiers environment package (verifiers >= 0.4, `verifiers.v1`), loaded by its id with
    verifiers' own loader; its tasks are played token-exactly by the orchestrator, its rubric gives the reward.
    Needs `pip install 'prime-rl-orchestrator[verifiers]'` and the environment's package."""

    type: Literal["verifiers"] = "verifiers"
    """Environment kind."""
    id: str = Field(min_length=1)
    """Environment (taskset) id: the installed package's name, e.g. `vf-arithmetic` (imports `vf_arithmetic`)."""
    args: dict[str, Any] = {}
    """The taskset's config (what `vf-eval --env.taskset.*` sets), e.g. `{ num_tasks = 200, task = { tools = true } }`."""
    max_turns: int = Field(default=4, ge=2)
    """Most assistant turns per rollout (tool calls, then the answer); a taskset without tools takes one."""
    max_tasks: int = Field(default=100_000, ge=1)
    """Tasks read from a taskset that yields tasks forever (a finite one is read whole)."""

    @property
    def resolved_name(self) -> str:
        return self.name or self.id


EnvConfig = Annotated[
    ReverseTextEnvConfig
    | ArithmeticEnvConfig
    | ReasoningGymEnvConfig
    | ToolArithmeticEnvConfig
    | PythonEnvConfig
    | VerifiersEnvConfig,
    Field(discriminator="type"),
]


class AdvantageConfig(BaseConfig):
    """Group-relative advantages (GRPO style); see docs/algorithms.md for every variant."""

    baseline: Literal["mean", "leave_one_out"] = "mean"
    """What each reward is compared with: the group mean, or the mean of the other samples (RLOO)."""
    overlong_window: int = Field(default=0, ge=0)
    """DAPO length shaping: the last this many tokens before sampling.max_tokens get a linear penalty; 0 = off."""
    overlong_penalty: float = Field(default=1.0, ge=0)
    """Penalty subtracted from the reward of a completion that reaches max_tokens (linear in the window)."""
    std_normalize: bool = False
    """Divide (reward - group mean) by the group's reward std (Dr. GRPO leaves this off)."""
    eps: float = Field(default=1e-6, gt=0)
    """Added to the std before dividing."""
    filter_zero_advantage: bool = True
    """Leave groups whose rewards are all equal (zero advantage: no signal) out of the training batch."""


class DifficultyFilterConfig(BaseConfig):
    """Online difficulty filtering: train only on groups whose mean reward (pass rate) is inside [low, high]."""

    low: float = 0.0
    """Keep a group only if its mean reward is >= low (drops prompts that are too hard)."""
    high: float = 1.0
    """Keep a group only if its mean reward is <= high (drops prompts that are too easy)."""

    @model_validator(mode="after")
    def _check_band(self) -> DifficultyFilterConfig:
        if self.low > self.high:
            raise ValueError(f"difficulty_filter.low={self.low} must be <= difficulty_filter.high={self.high}")
        return self


class CurriculumConfig(BaseConfig):
    """Sample prompts by their past pass rate: each pick is one of `candidates` fresh tasks, weighted."""

    target: float = Field(default=0.5, ge=0, le=1)
    """Pass rate sampled most (0.5: prompts the policy solves half the time teach the most)."""
    width: float = Field(default=0.25, gt=0)
    """Std of the Gaussian weight around target: weight = exp(-(pass_rate - target)^2 / (2 width^2))."""
    min_weight: float = Field(default=0.05, gt=0, le=1)
    """Floor of every weight, so no prompt is never sampled again."""
    candidates: int = Field(default=8, ge=1)
    """Tasks drawn from the environment per pick; 1 = no curriculum (each draw is taken as is)."""
    ema: float = Field(default=0.5, gt=0, le=1)
    """Weight of the newest group in a prompt's pass-rate estimate (1 = only the last group counts)."""


class TeacherConfig(BaseConfig):
    """On-policy distillation: a second OpenAI-compatible (vLLM) server scores every sampled token."""

    base_url: str = Field(min_length=1)
    """Base URL of the teacher's API (e.g. http://host:8001/v1); required for distillation."""
    model: str = Field(min_length=1)
    """Model name the teacher server serves (its --served-model-name)."""
    coef: float = Field(default=1.0, gt=0)
    """Each completion token's advantage gets coef * (teacher logprob - sampler logprob) (reverse KL)."""
    reward_weight: float = Field(default=1.0, ge=0)
    """Multiplies the reward advantage; 0 = pure distillation (the reward is only logged)."""
    api_key: str = "EMPTY"
    """Bearer token sent to the teacher server."""
    timeout: float = Field(default=600.0, gt=0)
    """Seconds one teacher request may take before it is retried."""
    max_retries: int = Field(default=6, ge=0)
    """Retries of a failed teacher request before the run stops."""


_UNMODELED_WHY = (
    "the trainer computes log_softmax(logits / temperature) and cannot model it, so its logprobs would "
    "differ from the sampler's (biased gradient, large mismatch_kl)"
)


class SamplingConfig(BaseConfig):
    """Sampling parameters, sent explicitly with every request (the model's generation_config.json never applies)."""

    allow_unmodeled: bool = False
    """Accept top_p < 1, top_k, min_p and penalties although the trainer cannot model them (biased gradient)."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature (sent to the trainer too, which scales its logits by it)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling; 1 = off (the only value the trainer models)."""
    top_k: int = Field(default=-1, ge=-1)
    """Sample among the k most likely tokens; -1 (or 0) = off (the only value the trainer models)."""
    min_p: float = Field(default=0.0, ge=0, le=1)
    """Drop tokens below min_p times the top token's probability; 0 = off."""
    repetition_penalty: float = Field(default=1.0, gt=0)
    """vLLM's repetition penalty; 1 = off."""
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    """OpenAI presence penalty; 0 = off."""
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    """OpenAI frequency penalty; 0 = off."""
    max_tokens: int = Field(default=256, ge=1)
    """Most completion tokens per sample."""
    stop: list[str] = []
    """Strings that end a completion (its tokens so far are kept and trained on)."""
    seed: int | None = None
    """Base seed of the sampler: request i gets seed + i * group_size (reproducible); None = vLLM's own randomness."""

    @field_validator("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
    @classmethod
    def _modeled(cls, value: float, info: ValidationInfo) -> float:
        off = {"top_p": (1.0,), "top_k": (-1, 0), "min_p": (0.0,), "repetition_penalty": (1.0,)}.get(
            info.field_name, (0.0,)
        )
        if value not in off and not info.data.get("allow_unmodeled", False):
            raise ValueError(
                f"{info.field_name}={value} reshapes the sampled distribution: {_UNMODELED_WHY}; "
                f"use {off[0]}, or set sampling.allow_unmodeled = true to accept the bias"
            )
        return value


class TrainerEndpointConfig(BaseConfig):
    """Where the orchestrator sends TrainingBatch messages (it binds one socket per rank; ranks connect)."""

    address: str = "127.0.0.1"
    """Interface the orchestrator binds its ZeroMQ senders on ("0.0.0.0" when trainers are on other nodes)."""
    port: int = Field(default=29600, ge=1, le=MAX_PORT)
    """Port for trainer rank 0; rank r uses port + r (the trainer's data.port)."""
    send_timeout: float = Field(default=3600.0, gt=0)
    """Seconds to wait for a trainer rank to take a batch before failing."""
    weights_port: int = Field(default=29599, ge=1, le=MAX_PORT)
    """Port the orchestrator binds (on `address`) for the trainer's WeightsPublished announcements (the
    trainer's weight_broadcast.announce); the only way it learns of new policy versions."""


class InferenceControlConfig(BaseConfig):
    """The inference servers' control endpoints (pause / load weights / resume)."""

    addresses: list[str] = []
    """ZeroMQ control address of every inference server (tcp://host:port); empty = no weight updates sent."""
    pause_mode: Literal["abort", "wait", "keep"] = "keep"
    """What servers do with in-flight requests during a weight update (aborted rollouts are discarded)."""
    timeout: float = Field(default=600.0, gt=0)
    """Seconds to wait for a server to answer one control request."""
    sleep_level: int = Field(0, ge=0, le=2)
    """Colocated runs (`rl` sets it from `deployment.sleep_level`): put inference to sleep at this vLLM level after
    each step's rollouts, so the trainer has the GPUs, and wake it around the next weight load; 0 never sleeps."""
    outage_timeout: float = Field(default=0.0, ge=0)
    """Seconds to wait for inference to come back after it went away (restarted by `rl`, see
    `inference.max_restarts`): rollouts wait, the current policy is reloaded, then they are sent again.
    0: no waiting, a server that stays unreachable past the client's retries stops the run."""


class CheckpointConfig(BaseConfig):
    """Orchestrator state (step, task-sampling rng) under checkpoints/step_<n>/orchestrator/."""

    interval: int | None = Field(default=None, ge=1)
    """Save every this many steps; None never saves."""
    resume_step: int | Literal["latest"] | None = None
    """Resume from checkpoints/step_<n>/orchestrator ("latest": the newest there is; None starts fresh)."""


class EvalSetConfig(BaseConfig):
    """What is evaluated and how (shared by offline and online evaluations)."""

    env: list[EnvConfig] = Field(default_factory=list)
    """Environments to evaluate (`[[eval.env]]`); online, empty = the training environments."""
    num_examples: int = Field(default=32, ge=1)
    """Tasks per environment."""
    rollouts_per_example: int = Field(default=4, ge=1)
    """Rollouts per task (pass@k is reported for k = 1, 2, 4, ... up to this)."""
    pass_threshold: float = 1.0
    """A rollout passes (for pass@k) when its reward is >= this."""
    seed: int = 12345
    """Seed of the eval tasks; keep it apart from the training seed for a held-out split."""
    sampling: SamplingConfig | None = None
    """Sampling for evaluation; None = the training sampling (offline: the defaults)."""

    @model_validator(mode="before")
    @classmethod
    def _one_env_table(cls, data):
        if isinstance(data, dict) and isinstance(data.get("env"), dict):
            data = {**data, "env": [data["env"]]}
        return data


class OnlineEvalConfig(EvalSetConfig):
    """`[orchestrator.eval]`: evaluate the policy every `interval` steps while training."""

    interval: int = Field(default=10, ge=1)
    """Evaluate after every this many steps (and log eval/<env>/... rows at that step)."""
    at_start: bool = True
    """Also evaluate the initial policy (row 0), the start of the eval curve."""


class OrchestratorConfig(RunSectionConfig):
    """The orchestrator: samples rollouts from inference, scores them and ships packed batches to the trainer."""

    run_name: str = "rl"
    """Run directory name: <output_dir>/<run_name> (broadcasts/, checkpoints/, monitors/ live there)."""
    model: ClientModelConfig = ClientModelConfig()
    """The served model."""
    env: list[EnvConfig] = Field(default_factory=lambda: [ReverseTextEnvConfig()], min_length=1)
    """The environments tasks come from (`[[orchestrator.env]]`, discriminated on type; one `[env]` table
    is accepted too), each drawn by its weight."""
    advantage: AdvantageConfig = AdvantageConfig()
    """Advantage computation."""
    difficulty_filter: DifficultyFilterConfig | None = None
    """Train only on groups whose mean reward is inside [low, high]; None = off."""
    curriculum: CurriculumConfig | None = None
    """Sample prompts by past pass rate; None = uniform (the environment's own sampling)."""
    teacher: TeacherConfig | None = None
    """On-policy distillation from a teacher server; None = off."""
    eval: OnlineEvalConfig | None = None
    """Online evaluations every `eval.interval` steps on held-out tasks; None = off."""
    trainer: TrainerEndpointConfig = TrainerEndpointConfig()
    """The ZeroMQ endpoint trainer ranks pull batches from."""
    inference: InferenceControlConfig = InferenceControlConfig()
    """Inference control plane for weight updates."""
    ckpt: CheckpointConfig = CheckpointConfig()
    """Checkpointing of the orchestrator's own state."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters sent with every request."""

    batch_size: int = Field(default=128, ge=1)
    """Samples (completions) per training step; a multiple of group_size."""
    group_size: int = 8
    """Completions sampled per task (>= 2); advantages are relative to the group."""
    seq_len: int = Field(default=2048, ge=2)
    """Tokens per packed micro-batch (samples are packed back to back, positions restart per sample)."""
    max_model_len: int | None = Field(default=None, ge=2)
    """Longest prompt + completion the inference server takes (its max_model_len): multi-turn rollouts stop at
    the lower of this and seq_len. None = seq_len. `rl` sets it from inference.vllm.max_model_len."""
    max_off_policy_steps: int = Field(default=1, ge=0)
    """Most policy versions a rollout may lag the step it is trained in; older rollouts are dropped."""
    max_concurrent_groups: int | None = Field(default=None, ge=1)
    """Groups (requests) in flight at once; None = one step's worth (batch_size // group_size)."""
    concurrency: Literal["fixed", "load"] = "load"
    """"load": at least `max_concurrent_groups` in flight, more while they raise the inference server's generation
    rate (vLLM's /metrics: nothing queued, KV cache room, and tokens/s up by half the added groups' share, or the
    raise is taken back and tried again later, less often each time it buys nothing), up to every group the policy
    gate admits (`groups_per_step * (max_off_policy_steps + 1)`); the added groups go again while its queue is over
    four batches deep or it preempts sequences for want of KV cache. See orchestrator/concurrency.py and
    docs/environments.md (measured). "fixed": always `max_concurrent_groups`. Synchronous runs
    (`max_off_policy_steps = 0`) keep `max_concurrent_groups` either way."""
    num_train_ranks: int = Field(default=1, ge=1)
    """Trainer data-parallel ranks; each gets the same number of micro-batches per step."""
    max_steps: int | None = Field(default=None, ge=1)
    """Stop after this many steps; None runs until interrupted."""
    seed: int = 0
    """Seed of task sampling."""
    routed_experts: bool = False
    """Ask inference for the experts each token was routed to (vLLM's `enable_return_routed_experts`, MoE only)
    and send them to the trainer, which logs `router/expert_mismatch` and, with
    `trainer.model.moe.router_replay`, routes by them."""
    weights_poll_interval: float = Field(default=0.1, gt=0)
    """Seconds between polls of the trainer's version announcements (trainer.weights_port)."""
    weights_timeout: float = Field(default=3600.0, gt=0)
    """Seconds to wait for the trainer to publish the weights a step needs before giving up."""
    monitor: MonitorConfig = MonitorConfig()
    """Metrics sinks besides metrics.jsonl: `[monitor.wandb]` logs to Weights & Biases."""

    @model_validator(mode="before")
    @classmethod
    def _move_legacy_sampling_keys(cls, data: Any) -> Any:
        """`temperature` / `max_tokens` used to sit at the top level: still accepted there, moved into [sampling]."""
        if not isinstance(data, dict) or not ({"temperature", "max_tokens"} & data.keys()):
            return data
        data = dict(data)
        sampling = data.get("sampling", {})
        sampling = sampling.model_dump(exclude_unset=True) if isinstance(sampling, BaseConfig) else dict(sampling)
        for key in ("temperature", "max_tokens"):
            if key not in data:
                continue
            value = data.pop(key)
            if key in sampling and sampling[key] != value:
                raise ValueError(
                    f"{key}={value!r} and sampling.{key}={sampling[key]!r} disagree; {key} is the old name "
                    f"of sampling.{key}: keep only sampling.{key}"
                )
            sampling[key] = value
        data["sampling"] = sampling
        return data

    @field_validator("env", mode="before")
    @classmethod
    def _one_env_table(cls, value: Any) -> Any:
        return [value] if isinstance(value, (dict, BaseConfig)) else value

    @field_validator("env")
    @classmethod
    def _unique_env_names(cls, value: list[Any]) -> list[Any]:
        names = [e.resolved_name for e in value]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(
                f"environment names {duplicates} appear more than once; give each [[orchestrator.env]] entry "
                'of the same type its own name = "..."'
            )
        return value

    @field_validator("group_size")
    @classmethod
    def _group_of_at_least_two(cls, value: int) -> int:
        if value < 2:
            raise ValueError(
                f"group_size={value}: advantages are relative to the group, so a group of {value} has zero "
                "advantage and learns nothing; use group_size >= 2 (8 is common)"
            )
        return value

    @model_validator(mode="after")
    def _check_sizes(self) -> OrchestratorConfig:
        if self.batch_size % self.group_size:
            raise ValueError(
                f"batch_size={self.batch_size} must be a multiple of group_size={self.group_size}; "
                f"use {max(1, self.batch_size // self.group_size) * self.group_size}"
            )
        if self.sampling.max_tokens >= self.seq_len:
            raise ValueError(
                f"sampling.max_tokens={self.sampling.max_tokens} must be below seq_len={self.seq_len} so a prompt "
                "fits beside it; raise seq_len or lower sampling.max_tokens"
            )
        for env in self.env:
            if isinstance(env, ReverseTextEnvConfig) and env.min_len > env.max_len:
                raise ValueError(
                    f"env.min_len={env.min_len} must be <= env.max_len={env.max_len} ({env.resolved_name})"
                )
        return self

    @model_validator(mode="after")
    def _check_advantage(self) -> OrchestratorConfig:
        if self.advantage.overlong_window > self.sampling.max_tokens:
            raise ValueError(
                f"advantage.overlong_window={self.advantage.overlong_window} must be <= "
                f"sampling.max_tokens={self.sampling.max_tokens} (the window ends at max_tokens); lower it"
            )
        return self

    @model_validator(mode="after")
    def _check_samples_api(self) -> OrchestratorConfig:
        if self.model.client.api == "samples" and self.routed_experts:
            raise ValueError(
                "orchestrator.model.client.api='samples' does not return routed experts, which "
                "orchestrator.routed_experts=true asks for; use api='chat' with routed experts (router replay)"
            )
        return self

    @property
    def max_sample_len(self) -> int:
        """Longest sample asked of inference: seq_len, or the server's max_model_len when that is lower."""
        return min(self.seq_len, self.max_model_len or self.seq_len)

    @property
    def groups_per_step(self) -> int:
        return self.batch_size // self.group_size

    @property
    def base_concurrent(self) -> int:
        """Groups in flight with "fixed", and the floor of "load": `max_concurrent_groups`, one step's unless set."""
        return self.max_concurrent_groups or self.groups_per_step

    @property
    def max_concurrent(self) -> int:
        """Most groups ever in flight: `base_concurrent` with "fixed"; with "load" at least every group the policy
        gate can admit, `groups_per_step * (max_off_policy_steps + 1)`."""
        if self.concurrency == "fixed":
            return self.base_concurrent
        return max(self.base_concurrent, self.groups_per_step * (self.max_off_policy_steps + 1))
