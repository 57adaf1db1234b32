"""The trainable module: the FSDP root around a model, whose forward is one micro-batch's loss inputs.

`CausalLM.forward` runs the whole micro-batch (transformer + LM head + log-softmax, all the model's own:
`Transformer.token_outputs`) inside the root's forward, so that FSDP's root unit, which
owns the embedding and the (possibly tied) LM head, holds them gathered for the entire forward: the fused
kernel reads the unsharded bf16 weight and its gradient flows back into FSDP's reduce-scatter like any
other. What stays here is the run's choice of LM-head chunk (`model.fused_lm_head_token_chunk_size`).

`build_training_model` does the heavy work in a fixed order: build on meta -> parallelize (compile,
FSDP) -> allocate the local shards -> load the Hugging Face weights (each rank reads the safetensors
and keeps its own shard).
"""

from pathlib import Path
from typing import Any

import torch
from torch import nn

from prime_rl.common.config.trainer import TrainerModelConfig
from prime_rl.trainer.lora import apply_lora, init_lora_weights, is_lora_param
from prime_rl.trainer.memory_plan import require_resolved
from prime_rl.trainer.models import build_model, load_hf_weights
from prime_rl.trainer.parallel import ParallelDims, WorldMesh, parallelize_model


class CausalLM(nn.Module):
    def __init__(self, model: nn.Module, chunk_size: int | None):
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size
        """Tokens per fused LM-head chunk; None materializes the full [T, V] logits."""

    @property
    def config(self):  # noqa: ANN201 - the models package's TrainerModelConfig
        return self.model.config

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        targets: torch.Tensor,
        temperature: float = 1.0,
        **options: Any,
    ) -> tuple[torch.Tensor, ...] | torch.Tensor:
        """`Transformer.token_outputs` with this run's ``chunk_size``; ``options`` are its keywords (``seqs``,
        ``nll_sum``, ``token_loss``), documented there once. (1, T) ids, positions, targets -> (logprobs, entropy),
        or SFT's -sum of logprobs (``nll_sum=True``), or RL's (loss, logprobs, entropy) (``token_loss``)."""
        # The model's own method, not a copy of its signature: this forward exists only because it is the FSDP
        # root's, which must take the micro-batch itself so that its unit stays gathered for the whole head.
        return self.model.token_outputs(
            input_ids, position_ids, targets, temperature, chunk_size=self.chunk_size, **options
        )


def build_training_model(
    cfg: TrainerModelConfig, dims: ParallelDims, mesh: WorldMesh, device: torch.device
) -> CausalLM:
    require_resolved(cfg, "build_training_model")
    # fp32 masters, except under full offload: the masters live on CPU, the device keeps bf16 weights
    dtype = torch.bfloat16 if cfg.offload == "full" else torch.float32
    # LoRA: the frozen base is never stepped, so it is stored in bf16, what compute casts it to anyway (same
    # numbers, half the memory); only the trainable tensors keep `dtype` masters
    model = build_model(cfg.name, attn=cfg.attn, dtype=torch.bfloat16 if cfg.lora else dtype, device="meta")
    if cfg.lora is not None:  # before parallelize: adapters shard, checkpoint and compile with their block
        apply_lora(model, cfg.lora, trainable_dtype=dtype)
    chunk = None if cfg.fused_lm_head_token_chunk_size == "disabled" else cfg.fused_lm_head_token_chunk_size
    root = CausalLM(model, chunk)
    parallelize_model(root, model, dims, mesh, cfg)
    root.to_empty(device=device)
    model.tie_weights()
    load_hf_weights(model, Path(cfg.name), ignore=is_lora_param)
    if cfg.lora is not None:
        init_lora_weights(model, seed=torch.initial_seed())
    return root
