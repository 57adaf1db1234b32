"""CausalLM's SFT loss path (`nll_sum=True`, the cross-entropy-only head) against its logprob path."""

from __future__ import annotations

import pytest
import torch

from prime_rl.kernels import IGNORE_INDEX
from prime_rl.trainer.model import CausalLM
from prime_rl.trainer.models import build_model, load_hf_weights


@pytest.mark.parametrize("chunk_size", [None, 16])  # the vanilla head and the fused one
@pytest.mark.parametrize("tied", [False, True])
def test_nll_sum_equals_minus_summed_logprobs_with_the_same_gradients(hf_model_factory, packed, chunk_size, tied):
    _, path = hf_model_factory("qwen3", tie_word_embeddings=tied)
    model = build_model(path, attn="sdpa", dtype=torch.float32, device="cpu")
    load_hf_weights(model, path)
    root = CausalLM(model, chunk_size)
    input_ids, position_ids = packed([9, 20, 13], model.config.vocab_size)
    targets = input_ids.roll(-1, dims=1)
    targets[0, ::5] = IGNORE_INDEX

    logprobs, _ = root(input_ids, position_ids, targets, temperature=0.8)
    (-logprobs.sum()).backward()
    expected = {n: p.grad.clone() for n, p in root.named_parameters()}
    root.zero_grad()

    nll = root(input_ids, position_ids, targets, temperature=0.8, nll_sum=True)
    nll.backward()
    assert nll.shape == () and nll.dtype == torch.float32
    torch.testing.assert_close(nll, -logprobs.detach().sum(), rtol=1e-5, atol=1e-5)
    for name, p in root.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
