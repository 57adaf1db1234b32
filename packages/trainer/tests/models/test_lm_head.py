"""The model's output-layer contract: `Transformer.token_logprobs` / `token_nll_sum` equal what the full
[T, V] logits of `lm_head` give, in value and in gradient, tied to the embedding or not, fused or not."""

from __future__ import annotations

import pytest
import torch

from prime_rl.kernels import IGNORE_INDEX
from prime_rl.trainer.models import build_model, load_hf_weights

TEMPERATURE = 0.8


def reference(model, input_ids, position_ids, targets):  # noqa: ANN001, ANN201
    """(logprobs, entropy) of the tempered distribution from the materialized logits; ignored targets give 0."""
    logits = model.lm_head(model(input_ids, position_ids)).flatten(0, 1).float() / TEMPERATURE  # (T, V)
    logp = torch.log_softmax(logits, dim=-1)
    targets = targets.flatten()
    ignored = targets < 0
    picked = logp.gather(1, targets.clamp(min=0)[:, None])[:, 0].masked_fill(ignored, 0.0)
    entropy = -(logp.exp() * logp).sum(-1)
    return picked, entropy


def grads(model) -> dict[str, torch.Tensor]:  # noqa: ANN001
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def check_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tied: bool) -> None:
    # tied: the one matrix is both embedding and LM head, and its gradient holds both parts
    assert got.keys() == want.keys() and ("lm_head.weight" in got) != tied
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("chunk_size", [None, 16])  # the full logits and the fused head
@pytest.mark.parametrize("tied", [False, True])
def test_token_logprobs_and_nll_sum_match_the_full_logits(hf_model_factory, packed, chunk_size, tied):
    _, path = hf_model_factory("qwen3", tie_word_embeddings=tied)
    model = build_model(path, attn="sdpa", dtype=torch.float32, device="cpu")
    load_hf_weights(model, path)
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    input_ids, position_ids = packed([9, 20, 13], model.config.vocab_size)
    targets = input_ids.roll(-1, dims=1)
    targets[0, ::5] = IGNORE_INDEX

    want_logp, want_entropy = reference(model, input_ids, position_ids, targets)
    (want_logp.sum() + 0.1 * want_entropy.sum()).backward()
    want_grads = grads(model)
    logp, entropy = model.token_logprobs(input_ids, position_ids, targets, TEMPERATURE, chunk_size=chunk_size)
    assert logp.shape == entropy.shape == (input_ids.numel(),) and logp.dtype == torch.float32
    torch.testing.assert_close(logp, want_logp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy.detach(), rtol=1e-5, atol=1e-5)
    (logp.sum() + 0.1 * entropy.sum()).backward()
    check_grads(grads(model), want_grads, tied)

    (-reference(model, input_ids, position_ids, targets)[0].sum()).backward()
    want_grads = grads(model)
    nll = model.token_nll_sum(input_ids, position_ids, targets, TEMPERATURE, chunk_size=chunk_size)
    assert nll.shape == () and nll.dtype == torch.float32
    torch.testing.assert_close(nll, -want_logp.detach().sum(), rtol=1e-5, atol=1e-5)
    nll.backward()
    check_grads(grads(model), want_grads, tied)


@pytest.mark.parametrize("chunk_size", [None, 16])  # the full logits and the fused head
@pytest.mark.parametrize("tied", [False, True])
def test_a_token_loss_through_the_head_matches_autograd_on_the_full_logits(hf_model_factory, packed, chunk_size, tied):
    """RL's token-level loss given to the head (``token_loss``): the loss, its parameter gradients (formed in
    the forward when fused) and the logprobs / entropy it reports equal autograd through the full logits."""
    _, path = hf_model_factory("qwen3", tie_word_embeddings=tied)
    model = build_model(path, attn="sdpa", dtype=torch.float32, device="cpu")
    load_hf_weights(model, path)
    input_ids, position_ids = packed([9, 20, 13], model.config.vocab_size)
    targets = input_ids.roll(-1, dims=1)
    targets[0, ::5] = IGNORE_INDEX
    g = torch.Generator().manual_seed(0)
    inference = reference(model, input_ids, position_ids, targets)[0].detach() + 0.6 * torch.randn(42, generator=g)
    advantages = torch.randn(42, generator=g)

    def token_loss(logprobs, t0, t1):  # noqa: ANN001, ANN202 - an importance ratio, masked outside [0.5, 2]
        ratio = torch.exp(logprobs - inference[t0:t1])
        keep = (ratio > 0.5) & (ratio < 2.0)
        return torch.where(keep, -ratio * advantages[t0:t1], 0.0).sum() / 7.0

    want_logp, want_entropy = reference(model, input_ids, position_ids, targets)
    ratio = torch.exp(want_logp.detach() - inference)
    assert ((ratio <= 0.5) | (ratio >= 2.0)).sum() >= 3  # the mask, which reads the logprob, is live
    want_loss = token_loss(want_logp, 0, 42)
    want_loss.backward()
    want_grads = grads(model)
    loss, logp, entropy = model.token_outputs(
        input_ids, position_ids, targets, TEMPERATURE, chunk_size=chunk_size, token_loss=token_loss
    )
    assert not logp.requires_grad and not entropy.requires_grad
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logp, want_logp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy.detach(), rtol=1e-5, atol=1e-5)
    loss.backward()
    check_grads(grads(model), want_grads, tied)
