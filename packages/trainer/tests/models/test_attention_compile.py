"""Attention under torch.compile with dynamic shapes, on CPU: what `model.compile = "auto"` does on CUDA."""

import torch

from prime_rl.trainer.models.attention import dense_causal_attention


def test_gqa_attention_compiles_with_dynamic_shapes():
    """Head counts become symbolic under dynamic shapes; SDPA's `enable_gqa` must still get a bool (Nemotron-H's
    GQA attention failed to compile on an H200 with "argument 'enable_gqa' must be bool, not SymBool")."""
    torch.manual_seed(0)
    q, k, v = torch.randn(64, 4, 16), torch.randn(64, 2, 16), torch.randn(64, 2, 16)
    compiled = torch.compile(dense_causal_attention, dynamic=True, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, 2), dense_causal_attention(q, k, v, 2))
