"""RL trainer config: `trainer @ train.toml` (or `[trainer]` inside an `rl` config).

It shares the model, optimizer, scheduler and checkpoint sections with SFT; what differs is where the
data comes from (the orchestrator over ZeroMQ, or fake rows for benchmarks), the loss, and how new
weights are published to inference.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from prime_rl.common.config.base import MAX_PORT, BaseConfig
from prime_rl.common.config.trainer import CheckpointConfig, TrainerRunConfig

AUTO_MICRO_BATCH_TOKENS = 8192
"""`data.micro_batch_tokens = "auto"` gives forwards of at least this many tokens: on an H200 (Qwen3-1.7B shape)
8k-token forwards ran at 33k tokens/s where one 2k-token row per forward ran at 7-12k (BENCHMARKS.md, issue 29)."""


class FakeRLDataConfig(BaseConfig):
    """Random rows instead of the orchestrator: benchmark the trainer alone."""

    batch_size: int = Field(8, ge=1)
    """Packed rows per step over all ranks."""
    generate_samples: bool = False
    """Pack random-length samples into each row (positions restart per sample) instead of one row-long sample."""
    doc_len: int | None = Field(None, ge=1)
    """With generate_samples: every sample has this many tokens (the last one cut to fill the row)."""
    seed: int = 0
    """Seed of the random tokens."""


class RLDataConfig(BaseConfig):
    """Where training batches come from."""

    seq_len: int = Field(2048, ge=2)
    """Tokens per packed row (fake data; orchestrator rows carry their own length)."""
    micro_batch_tokens: int | Literal["auto"] | None = "auto"
    """Tokens per forward pass: each received row is trimmed after its last loss token's sample and consecutive
    rows of one temperature are concatenated up to this budget (a longer row is its own forward); "auto" =
    max(seq_len, 8192); None = one forward per received row, untrimmed."""
    host: str = "127.0.0.1"
    """Host of the orchestrator's ZeroMQ batch socket."""
    port: int = Field(29600, ge=1, le=MAX_PORT)
    """Port of the orchestrator's ZeroMQ batch socket (rank r connects to port + r)."""
    timeout: float = Field(3600.0, gt=0)
    """Seconds to wait for the next batch before failing."""
    fake: FakeRLDataConfig | None = None
    """Fake data for benchmarks (`--data.fake`); None reads batches from the orchestrator."""

    @model_validator(mode="after")
    def _check_budget(self) -> RLDataConfig:
        if isinstance(self.micro_batch_tokens, int) and self.micro_batch_tokens < 2:
            raise ValueError(
                f'data.micro_batch_tokens={self.micro_batch_tokens} must be >= 2, "auto" (max(seq_len, 8192)) or None '
                "(one forward per received row)"
            )
        return self

    @property
    def tokens_per_forward(self) -> int | None:
        """The resolved token budget of one forward; None: one forward per received row."""
        if self.micro_batch_tokens == "auto":
            return max(self.seq_len, AUTO_MICRO_BATCH_TOKENS)
        return self.micro_batch_tokens


class KLConfig(BaseConfig):
    """A KL penalty against the reference policy: the initial weights, kept frozen by the trainer."""

    coef: float = Field(gt=0)
    """Weight of the per-token KL estimate in the loss."""
    estimator: Literal["k1", "k3"] = "k3"
    """k1 = log p - log ref; k3 = ref/p - log(ref/p) - 1 (>= 0, lower variance)."""


class _LossBase(BaseConfig):
    norm: Literal["token", "sequence", "constant"] = "token"
    """Normalization: "token" = mean over the step's loss tokens; "sequence" = mean over samples of each
    sample's token mean; "constant" (Dr. GRPO) = sum / (samples x max_len)."""
    max_len: int | None = Field(None, ge=1)
    """The fixed length of the "constant" normalization (e.g. the orchestrator's max_tokens)."""
    kl: KLConfig | None = None
    """KL control against the initial weights (`[trainer.loss.kl] coef = ...`); None = off."""

    @model_validator(mode="after")
    def _check_norm(self) -> _LossBase:
        if self.norm == "constant" and self.max_len is None:
            raise ValueError('loss.norm = "constant" needs loss.max_len (the fixed length to divide by)')
        if self.norm != "constant" and self.max_len is not None:
            raise ValueError(f'loss.max_len={self.max_len} applies only to loss.norm = "constant" (got {self.norm!r})')
        return self


class TokenLossConfig(_LossBase):
    """Importance-ratio policy gradient per token, masking tokens whose ratio leaves the bounds (default)."""

    type: Literal["token"] = "token"
    token_mask_low: float = Field(0.125, gt=0, lt=1)
    """Mask loss tokens whose trainer/inference probability ratio is below this."""
    token_mask_high: float = Field(8.0, gt=1)
    """Mask loss tokens whose trainer/inference probability ratio is above this."""


class SequenceLossConfig(_LossBase):
    """GSPO: one importance ratio per sample (geometric mean of its token ratios), masking whole samples."""

    type: Literal["sequence"] = "sequence"
    norm: Literal["token", "sequence", "constant"] = "sequence"
    """Normalization (see the token loss); "sequence" gives GSPO's mean over samples."""
    sequence_mask_low: float = Field(0.5, gt=0, lt=1)
    """Mask samples whose sequence ratio is below this (must be < 1, or on-policy samples are masked)."""
    sequence_mask_high: float = Field(2.0, gt=1)
    """Mask samples whose sequence ratio is above this (must be > 1, or on-policy samples are masked)."""


LossConfig = Annotated[TokenLossConfig | SequenceLossConfig, Field(discriminator="type")]


class _PublishConfig(BaseConfig):
    """What every weight transport shares: announcing each complete version to the orchestrator."""

    announce: str | None = None
    """Orchestrator's version socket (tcp://host:port, its trainer.weights_port): rank 0 sends a WeightsPublished
    message there once each version is complete. `rl` sets it; None announces nothing (benchmarks)."""
    announce_timeout: float = Field(600.0, gt=0)
    """Seconds to wait for the orchestrator to take an announcement before failing."""


class FilesystemBroadcastConfig(_PublishConfig):
    """Publish weights as safetensors under <run_dir>/broadcasts/step_<n>/, written in the background and
    renamed into place atomically (memory: one pinned host copy of the weights in `dtype` on rank 0)."""

    type: Literal["filesystem"] = "filesystem"
    keep_last: int = Field(2, ge=1)
    """Older published steps are deleted, keeping this many."""
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    """Dtype of the published tensors: must be the dtype inference serves the model in."""


class _PushConfig(_PublishConfig):
    """What the transports that push into running inference workers (NCCL, NIXL) share."""

    host: str = "127.0.0.1"
    """Where inference reaches the trainer: the NCCL group's rendezvous (trainer rank 0), or the NIXL metadata
    service (the trainer head node; started there by the SLURM job)."""
    port: int = Field(ge=1, le=MAX_PORT)
    """Port on `host`; each transport sets its default."""
    timeout: float = Field(600.0, gt=0)
    """Seconds to wait for inference: to join the NCCL group, or for a NIXL peer (metadata, a readiness
    notification, a read or a buffer credit)."""
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    """Dtype of the transferred tensors: must be the dtype inference serves the model in."""
    inference_addresses: list[str] = []
    """Control endpoints (tcp://host:port) of the inference servers to update."""
    keep_rollback_copy: bool = True
    """Each inference worker keeps a host copy of the last complete update (the model's checkpoint-format weights
    in `dtype`) and reloads it when an update breaks midway or, over NCCL, carries NaN/Inf."""


class NCCLBroadcastConfig(_PushConfig):
    """Broadcast weights from trainer rank 0 into the inference workers (NCCL on GPU, gloo on CPU)."""

    type: Literal["nccl"] = "nccl"
    port: int = Field(29700, ge=1, le=MAX_PORT)
    """Rendezvous port of the broadcast group."""


class NixlBroadcastConfig(_PushConfig):
    """Inference workers read the weights from every trainer rank over NIXL (UCX), group by group."""

    type: Literal["nixl"] = "nixl"
    port: int = Field(29710, ge=1, le=MAX_PORT)
    """Port of the NIXL metadata service; trainer rank 0 starts one in process if none answers there."""
    group_bytes: int = Field(256 << 20, ge=1 << 10)
    """Bytes per transfer group: the size of one transfer arena (a bigger tensor gets a group of its own)."""
    overlap_transfer_and_replay: bool = False
    """Two arenas on each side: load one group into the engine while the next is received."""


class IpcBroadcastConfig(_PushConfig):
    """Trainer rank 0 fills a ring of shared buckets that inference on the same host reads in place: no disk,
    no NCCL (one GPU shared by trainer and inference cannot hold two NCCL ranks). Colocated on several nodes
    (SLURM): each node's local rank 0 fills its own node's servers' buckets."""

    type: Literal["ipc"] = "ipc"
    port: int = Field(29720, ge=1, le=MAX_PORT)
    """Port of the bucket channel (a TCP store on trainer rank 0: buckets ready, buckets read); on several nodes,
    node i's leader listens on 127.0.0.1, port + i (nodes that are one machine do not collide)."""
    memory: Literal["device", "host"] = "device"
    """Where the buckets live: "device", the trainer's GPU, opened by the workers through CUDA IPC (inference
    on the trainer's GPUs); "host", files in /dev/shm (CPU inference, or inference on other GPUs of the host)."""
    bucket_bytes: int = Field(1 << 30, ge=1 << 20)
    """Bytes per bucket; two buckets (plus one larger tensor, if any) is the transport's extra memory."""


WeightBroadcastConfig = Annotated[
    FilesystemBroadcastConfig | NCCLBroadcastConfig | NixlBroadcastConfig | IpcBroadcastConfig,
    Field(discriminator="type"),
]


class RLTrainerConfig(TrainerRunConfig):
    """The RL trainer: receives packed rollouts, steps the policy, publishes weights."""

    data: RLDataConfig = RLDataConfig()
    """Batches from the orchestrator, or fake data."""
    loss: LossConfig = TokenLossConfig()
    """The policy-gradient loss: `type = "token"` (default) or `"sequence"` (GSPO), normalization, KL."""
    ckpt: CheckpointConfig = CheckpointConfig(export_hf=False)
    """Checkpointing and resume (no Hugging Face export at the end: inference already has the weights)."""
    weight_broadcast: WeightBroadcastConfig = FilesystemBroadcastConfig()
    """How new weights reach inference."""
    run_name: str = "rl"
    """Run directory name: <output_dir>/<run_name>."""
    offload_between_steps: bool = False
    """Colocated runs (`rl` sets it): between steps hand the GPU back to inference (optimizer state to host,
    the caching allocator's free blocks to the driver) and log the memory of each phase (`memory/*`)."""
    env_vars: dict[str, str] = {}
    """Environment variables every trainer rank sets at start-up (e.g. CUDA_HOME); ${VAR} expands."""

    @model_validator(mode="after")
    def _check(self) -> RLTrainerConfig:
        fake = self.data.fake
        if fake is not None and fake.doc_len is not None and not fake.generate_samples:
            raise ValueError("data.fake.doc_len needs data.fake.generate_samples = true (it sets each sample's length)")
        cp, seq_len = self.model.cp, self.data.seq_len
        if self.data.micro_batch_tokens is None and seq_len % cp:  # rows go to the cp ranks as received, uncut
            fit = -(-seq_len // cp) * cp
            raise ValueError(
                f"data.micro_batch_tokens=None with model.cp={cp}: every received row of data.seq_len={seq_len} tokens "
                f"is one forward, split into {cp} equal slices; use data.seq_len={fit} or a data.micro_batch_tokens "
                "budget (forwards are then padded to a multiple of cp)"
            )
        lora = self.model.lora
        if lora is not None and self.weight_broadcast.type != "filesystem":
            raise ValueError(
                f"weight_broadcast.type={self.weight_broadcast.type!r} with model.lora: adapters are published "
                'through the filesystem only (vLLM loads LoRA adapters from a path); set weight_broadcast.type = "filesystem"'
            )
        if lora is not None and lora.modules_to_save:
            raise ValueError(
                f"model.lora.modules_to_save={lora.modules_to_save} in RL: vLLM serves LoRA adapters only, not modules "
                "trained in full, so inference would sample from other weights than the trainer's; leave it empty for RL"
            )
        return self
