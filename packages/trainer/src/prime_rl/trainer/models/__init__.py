"""Models the trainer trains: Qwen3, Qwen3-MoE, Llama, GLM-4.5 and Nemotron-H in plain PyTorch over packed sequences.

model = build_model(model_dir, attn="auto", dtype=torch.bfloat16, device="meta")
hidden = model(input_ids, position_ids)  # (1, T) -> (1, T, H), final-normed, no LM head
logits = model.lm_head(hidden)  # (1, T, V): what the parity tests compare with Hugging Face
logprobs, entropy = model.token_logprobs(input_ids, position_ids, targets, chunk_size=8192)  # (T,) each
nll = model.token_nll_sum(input_ids, position_ids, targets, chunk_size=8192)  # SFT's loss, a scalar
"""

from prime_rl.trainer.models.attention import ATTN_CHOICES, resolve_attn
from prime_rl.trainer.models.build import build_model
from prime_rl.trainer.models.config import ArchConfig, load_arch_config
from prime_rl.trainer.models.flops import model_flops_per_token, num_active_params
from prime_rl.trainer.models.moe import MoE
from prime_rl.trainer.models.packing import PackedSeqs
from prime_rl.trainer.models.transformer import Transformer, TransformerBlock
from prime_rl.trainer.models.weights import (
    hf_state_dict_to_model,
    load_hf_weights,
    model_state_dict_to_hf,
    read_hf_state_dict,
    save_hf_weights,
)

__all__ = [
    "ATTN_CHOICES",
    "ArchConfig",
    "MoE",
    "PackedSeqs",
    "Transformer",
    "TransformerBlock",
    "build_model",
    "hf_state_dict_to_model",
    "load_hf_weights",
    "load_arch_config",
    "model_flops_per_token",
    "model_state_dict_to_hf",
    "num_active_params",
    "read_hf_state_dict",
    "resolve_attn",
    "save_hf_weights",
]
