"""Trainer config schema (SFT today; the RL trainer extends it). Pydantic only: no torch here, so the
launcher validates a whole run, and `sft --dry-run` resolves one, without importing the trainer.

Names follow the user docs (scaling.md): `model.dp_replicate`, `model.reshard_after_forward`,
`model.offload`, `model.fused_lm_head_token_chunk_size`, `data.type = "fake"`, `optim.type = "sign_sgd"`,
`max_steps`. Checks that need the world size or the model's files (divisibility of the batch, the model
directory, the tokenizer) run at trainer start-up, before any heavy work.
"""

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from prime_rl.common.config.base import BaseConfig
from prime_rl.common.config.monitor import MonitorConfig
from prime_rl.common.config.run_section import RunSectionConfig


class CompileConfig(BaseConfig):
    """torch.compile applied to each transformer block (regional compile: fast to build, same speed)."""

    fullgraph: bool = True
    """Compile each block as one graph (fails loudly on a graph break instead of silently slowing down)."""


class ACConfig(BaseConfig):
    """Activation checkpointing of transformer blocks: recompute activations in backward instead of storing them."""

    mode: Literal["full", "selective"] = "full"
    """"full" recomputes whole blocks; "selective" keeps matmuls, attention and communication outputs."""

    targets: list[str] | None = None
    """Selective mode: operator names ("aten::mm") or namespaces ("_c10d_functional") to keep instead of the defaults."""

    freq: int = Field(1, ge=1)
    """Checkpoint every freq-th block (1 = all blocks)."""


class ACOffloadingConfig(BaseConfig):
    """Move tensors saved for backward to (pinned) CPU memory during forward and bring them back in backward."""

    max_inflight_activations: int = Field(5, ge=1)
    """Device->host copies allowed in flight before forward waits for the oldest (bounds the extra GPU memory)."""


class TorchDispatchConfig(BaseConfig):
    """Expert-parallel token dispatch with torch all-to-all collectives (works everywhere)."""

    type: Literal["torch"] = "torch"
    transport: Literal["bf16"] = "bf16"
    """Dtype of the dispatched tokens."""


class DeepEPDispatchConfig(BaseConfig):
    """Expert-parallel dispatch through DeepEP kernels (needs the `deep_ep` package)."""

    type: Literal["deepep"] = "deepep"
    num_sms: int = Field(24, ge=1)
    """SMs DeepEP's communication kernels may use."""
    token_chunk_size: int | None = Field(None, ge=1)
    """Dispatch tokens in chunks of this size; None sends them at once."""


class MegaMoEDispatchConfig(BaseConfig):
    """Fused dispatch + expert MLP + combine (prime-mega-moe `deep_gemm` build)."""

    type: Literal["mega_moe"] = "mega_moe"
    precision: Literal["bf16", "mxfp8", "fp8", "fp8_bwd"] = "bf16"
    """Expert GEMM precision."""
    num_reserved_sms: int = Field(16, ge=0)
    """SMs left free for NCCL kernels running beside the persistent MoE kernels."""
    max_tokens_per_rank: int | None = Field(None, ge=1)
    """Size of the symmetric buffer in tokens; None: a rank's share of the micro batch."""


MoEDispatchConfig = Annotated[
    TorchDispatchConfig | DeepEPDispatchConfig | MegaMoEDispatchConfig, Field(discriminator="type")
]


FP8_COMPUTE_REMOVED = (
    'type = "fp8" was removed: its grouped blockwise-FP8 expert GEMM measured 2.36x slower than bf16 forward + '
    'backward on an H200 (128 experts x top-8, H 2048, I 768; see BENCHMARKS.md); use type = "bf16"'
)
"""Why `[model.moe.compute] type = "fp8"` fails at config time (issue #32: >= 1.3x faster than bf16, or removed)."""


class BF16ComputeConfig(BaseConfig):
    """Routed-expert GEMMs in the activation dtype (bf16 under FSDP): the Triton grouped GEMM on CUDA."""

    type: Literal["bf16"] = "bf16"


class DeepGEMMFP8ComputeConfig(BaseConfig):
    """Blockwise FP8 through DeepGEMM's grouped GEMM (needs the `deep_gemm` package; not wired in yet)."""

    type: Literal["deepgemm_fp8"] = "deepgemm_fp8"


class MXFP8ComputeConfig(BaseConfig):
    """MXFP8 (1x32 blocks, e8m0 scales) grouped GEMMs (needs an SM100 GPU; not wired in yet)."""

    type: Literal["mxfp8"] = "mxfp8"


MoEComputeConfig = Annotated[
    BF16ComputeConfig | DeepGEMMFP8ComputeConfig | MXFP8ComputeConfig,
    Field(discriminator="type"),
]


class MoEConfig(BaseConfig):
    """Mixture-of-experts execution."""

    dispatch: MoEDispatchConfig = TorchDispatchConfig()
    """Expert-parallel token dispatch: `type = "torch"`, `"deepep"` or `"mega_moe"`."""

    compute: MoEComputeConfig = BF16ComputeConfig()
    """Routed-expert GEMM precision: `type = "bf16"`, `"deepgemm_fp8"` or `"mxfp8"` (the last two refuse at
    start-up); Mega MoE layers use `dispatch.precision` instead."""

    router_replay: bool = False
    """RL: route each sampled token to the experts inference chose for it (vLLM's routed experts, carried by the
    orchestrator); the routing weights still come from the trainer's router over those experts. Needs a MoE
    model and a vLLM that returns routed experts (`rl` sets `orchestrator.routed_experts`)."""

    @field_validator("compute", mode="before")
    @classmethod
    def _fp8_compute_was_removed(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") == "fp8":
            raise ValueError(FP8_COMPUTE_REMOVED)
        return value


DEFAULT_KEEP_LAST = 3
"""Checkpoints sft and the RL trainer keep unless told otherwise (`ckpt.keep_last`)."""

DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoRAConfig(BaseConfig):
    """Low-rank adapters (LoRA): W x + (alpha / rank) B A x on the targeted linear layers; the base weights stay
    frozen (no gradient, no optimizer state) and only the adapters (plus `modules_to_save`) train and are saved."""

    rank: int = Field(16, ge=1)
    """Rank r of each adapter: A is (r, in_features), B is (out_features, r)."""

    alpha: float = Field(32.0, gt=0)
    """Scaling numerator: the adapter's output is multiplied by alpha / rank."""

    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input (training only; the base path never sees it)."""

    target_modules: list[str] | str = DEFAULT_LORA_TARGETS
    """Linear layers to adapt, as in peft: a list of module-name suffixes ("q_proj", "self_attn.o_proj") or one
    regular expression matched against the whole module name ("layers\\.[0-3]\\..*_proj")."""

    modules_to_save: list[str] = []
    """Modules trained in full beside the adapters (e.g. "lm_head", "embed_tokens", "norm"), matched by suffix."""

    name: str | None = None
    """Name the adapter is served under by inference (rollouts request model=<name>); None: the run name."""

    export_merged: bool = False
    """With ckpt.export_hf: also write the merged Hugging Face weights (W + alpha/r B A) next to the adapter."""

    @field_validator("target_modules")
    @classmethod
    def _regex_compiles(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, str):
            try:
                re.compile(value)
            except re.error as e:
                raise ValueError(
                    f"model.lora.target_modules={value!r} is not a valid regular expression ({e}); fix it, or pass "
                    'a list of module-name suffixes like ["q_proj", "v_proj"]'
                ) from None
        return value


class TrainerModelConfig(BaseConfig):
    """The model and how it is laid out across GPUs."""

    name: str
    """Local Hugging Face model directory (config.json, *.safetensors, tokenizer files)."""

    attn: str = "auto"
    """Attention implementation passed to the model builder ("auto" picks the fastest available)."""

    dp_replicate: int = Field(1, ge=1)
    """Data-parallel replicas (HSDP): the world is a (dp_replicate, dp_shard) mesh; FSDP shards within a replica."""

    reshard_after_forward: bool | Literal["auto"] = "auto"
    """True frees the gathered parameters after each forward (backward gathers them again); false keeps them from a
    step's first forward to its last backward (one gather a step, not two per micro-batch): faster, 2 bytes a
    parameter more memory. "auto" keeps them where the memory plan (`model.offload = "auto"`) fits: false unless
    memory is tight or the optimizer is offloaded."""

    offload: Literal["auto", "none", "optimizer", "full"] = "auto"
    """CPU offload: "optimizer" keeps optimizer state on CPU between steps; "full" keeps fp32 masters, gradients
    and optimizer state on CPU and steps there (AdamW or SignSGD; disables gradient clipping); "none" disables it;
    "auto" picks at start-up from the parameter count, tokens per forward and free GPU memory (CPU: "none")."""

    ep: int | Literal["auto"] = "auto"
    """Expert-parallel degree (must divide num_experts); "auto": largest <= 8 dividing the FSDP island and experts."""

    cp: int = Field(1, ge=1)
    """Context-parallel (Ulysses) degree: shards each sequence over cp ranks; must divide the attention heads."""

    ac: ACConfig | Literal["auto"] | None = "auto"
    """Activation checkpointing: a `[model.ac]` table (or `--model.ac` for full AC) turns it on, "None" off;
    "auto" turns full AC on only when the memory plan needs it (never on CPU)."""

    ac_offloading: ACOffloadingConfig | Literal["auto"] | None = "auto"
    """Offload tensors saved for backward to CPU; "None" turns it off; "auto" turns it on only when the memory
    plan offloads everything else too (offload = "full")."""

    moe: MoEConfig = MoEConfig()
    """MoE dispatch / compute settings (used when the model has experts)."""

    fused_lm_head_token_chunk_size: int | Literal["disabled"] = 8192
    """Tokens per chunk of the fused LM head + log-softmax kernel; "disabled" materializes the full logits."""

    compile: CompileConfig | Literal["auto"] | None = "auto"
    """torch.compile each transformer block: a `[model.compile]` table (or `--model.compile`) turns it on, "None"
    off; "auto" compiles on CUDA and not on CPU (where Inductor's start-up costs more than it saves)."""

    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduce-scatter / all-reduce (parameters compute in bf16, masters stay fp32)."""

    lora: LoRAConfig | None = None
    """Train low-rank adapters on a frozen base (`[model.lora]`); None trains every weight."""

    @model_validator(mode="after")
    def _check(self) -> "TrainerModelConfig":
        if isinstance(self.ep, int) and self.ep < 1:
            raise ValueError(f'model.ep={self.ep} must be >= 1 or "auto"')
        if isinstance(self.fused_lm_head_token_chunk_size, int) and self.fused_lm_head_token_chunk_size < 1:
            raise ValueError(
                f'model.fused_lm_head_token_chunk_size={self.fused_lm_head_token_chunk_size} must be >= 1 or "disabled"'
            )
        return self


class _DataBase(BaseConfig):
    seq_len: int = Field(2048, ge=2)
    """Tokens per packed row; samples are packed into rows of exactly this length (padding is masked)."""

    batch_size: int = Field(8, ge=1)
    """Packed rows per optimizer step, over all data-parallel ranks."""

    micro_batch_size: int = Field(1, ge=1)
    """Packed rows per forward pass on one rank; the rest of a step is gradient accumulation."""

    seed: int = 0
    """Seed for shuffling (SFT) or random tokens (fake)."""


class SFTDataConfig(_DataBase):
    """Chat conversations from a local file; loss on assistant tokens only."""

    type: Literal["sft"] = "sft"

    path: Path
    """A .jsonl or .parquet file with a `messages` column of [{"role": ..., "content": ...}, ...]."""

    shuffle: bool = True
    """Shuffle samples each epoch (with `seed + epoch`) before packing."""


class FakeDataConfig(_DataBase):
    """Random tokens for benchmarking: no files, loss on every token."""

    type: Literal["fake"] = "fake"

    min_sample_len: int | None = Field(None, ge=2)
    """Shortest fake sample; None means every sample fills a whole row (seq_len tokens)."""

    max_sample_len: int | None = Field(None, ge=2)
    """Longest fake sample (defaults to seq_len); lengths are uniform in [min_sample_len, max_sample_len]."""

    @model_validator(mode="after")
    def _check(self) -> "FakeDataConfig":
        lo = self.min_sample_len or self.seq_len
        hi = self.max_sample_len or self.seq_len
        if not lo <= hi <= self.seq_len:
            raise ValueError(
                f"fake sample lengths need min_sample_len ({lo}) <= max_sample_len ({hi}) <= seq_len "
                f"({self.seq_len}); lower the sample lengths or raise data.seq_len"
            )
        return self


DataConfig = Annotated[SFTDataConfig | FakeDataConfig, Field(discriminator="type")]


class AdamWConfig(BaseConfig):
    """AdamW with decoupled weight decay."""

    type: Literal["adamw"] = "adamw"
    lr: float = Field(1e-5, ge=0)
    """Peak learning rate (after warmup)."""
    weight_decay: float = Field(0.01, ge=0)
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam (beta1, beta2)."""
    eps: float = 1e-8
    """Adam epsilon."""
    max_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value; None disables clipping (the norm is still logged)."""


class SignSGDConfig(BaseConfig):
    """SignSGD: p -= lr * sign(g); stateless, so it needs no optimizer memory."""

    type: Literal["sign_sgd"] = "sign_sgd"
    lr: float = Field(1e-5, ge=0)
    """Peak learning rate (after warmup)."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay."""
    max_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm before taking the sign; None disables clipping."""


OptimizerConfig = Annotated[AdamWConfig | SignSGDConfig, Field(discriminator="type")]


class ConstantSchedulerConfig(BaseConfig):
    """Linear warmup, then a constant learning rate."""

    type: Literal["constant"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warmup from 0 to the peak learning rate."""


class CosineSchedulerConfig(BaseConfig):
    """Linear warmup, then cosine decay to `min_lr_ratio * lr` at `max_steps`."""

    type: Literal["cosine"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warmup from 0 to the peak learning rate."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final learning rate as a fraction of the peak."""


SchedulerConfig = Annotated[ConstantSchedulerConfig | CosineSchedulerConfig, Field(discriminator="type")]


class CheckpointConfig(BaseConfig):
    """Distributed (DCP) checkpoints of model, optimizer, scheduler and step; Hugging Face export."""

    interval: int | None = Field(None, ge=1)
    """Save a checkpoint every this many steps (and at the last step); None saves none."""

    keep_last: int | None = Field(DEFAULT_KEEP_LAST, ge=1)
    """Keep only the newest this many checkpoints (a full state each fills a disk fast); None keeps all."""

    resume_step: int | Literal["latest"] | None = None
    """Resume from checkpoints/step_<N>; "latest" picks the newest one (or starts fresh if there is none)."""

    export_hf: bool = True
    """At the end of training write Hugging Face safetensors + config + tokenizer to <run_dir>/weights/step_<N>."""


class SingleNodeDeploymentConfig(BaseConfig):
    """All trainer ranks on this machine, launched by `sft` through torchrun."""

    type: Literal["single_node"] = "single_node"

    num_gpus: int | None = Field(None, ge=1)
    """Processes to launch (one per GPU; gloo processes on a CPU machine). None: $WORLD_SIZE or 1."""


class TrainerRunConfig(RunSectionConfig):
    """What every trainer run has, SFT or RL: the model, its optimizer and schedule, checkpoints, how long it
    trains, where it writes and how it logs. `SFTConfig` and `RLTrainerConfig` add their data and the rest."""

    model: TrainerModelConfig
    """The model and its parallel layout."""

    optim: OptimizerConfig = AdamWConfig()
    """Optimizer: `type = "adamw"` or `"sign_sgd"`."""

    scheduler: SchedulerConfig = ConstantSchedulerConfig()
    """Learning-rate schedule: `type = "constant"` or `"cosine"`."""

    ckpt: CheckpointConfig = CheckpointConfig()
    """Checkpointing and resume."""

    max_steps: int = Field(100, ge=1)
    """Optimizer steps to train for."""

    seed: int = 0
    """Seed for weight init of fresh parameters and for any randomness in training."""

    monitor: MonitorConfig = MonitorConfig()
    """Metrics sinks besides metrics.jsonl: `[monitor.wandb]` logs to Weights & Biases."""


class SFTConfig(TrainerRunConfig):
    """Supervised fine-tuning with FSDP2 on packed sequences."""

    data: DataConfig
    """Training data: `type = "sft"` (chat file) or `type = "fake"` (random tokens)."""

    deployment: SingleNodeDeploymentConfig = SingleNodeDeploymentConfig()
    """Where the trainer ranks run."""

    run_name: str = "sft"
    """Run directory name: everything goes to <output_dir>/<run_name>."""

    @model_validator(mode="after")
    def _check_layout(self) -> "SFTConfig":
        """The parallel layout and batch split, against the rank count when it is known and config.json."""
        from prime_rl.common.config.layout import check_batch, check_layout, read_model_shape

        world, world_key = _world_size(self.deployment)
        check_layout(self.model, world, read_model_shape(self.model.name), world_key=world_key)
        if world is not None:
            check_batch(self.data.batch_size, self.data.micro_batch_size, world // self.model.cp, world_key=world_key)
        return self


def _world_size(deployment: BaseConfig) -> tuple[int | None, str]:
    """Trainer ranks and the key that sets them; None when only the launch will know (no num_gpus, no
    $WORLD_SIZE: `sft` then starts one process, but a SLURM job's per-node config must not assume that)."""
    if getattr(deployment, "type", None) == "multi_node":  # the SLURM job's schema (prime_rl.launcher.slurm)
        return deployment.num_train_nodes * deployment.gpus_per_node, "deployment.gpus_per_node"
    if getattr(deployment, "num_gpus", None) is not None:
        return deployment.num_gpus, "deployment.num_gpus"
    if os.environ.get("WORLD_SIZE", "").isdigit():
        return int(os.environ["WORLD_SIZE"]), "deployment.num_gpus"
    return None, "deployment.num_gpus"
