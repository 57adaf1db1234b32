"""Equal-length documents run as one batched causal SDPA call (cuDNN first on CUDA); same result as the
block-diagonal mask path. AdamW is fused exactly when every parameter is on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prime_rl.common.config.trainer import AdamWConfig
from prime_rl.trainer.models import PackedSeqs
from prime_rl.trainer.models.attention import (
    SDPAAttention,
    VarlenAttention,
    dense_causal_attention,
    document_causal_mask,
    uniform_docs,
)
from prime_rl.trainer.optim import build_optimizer


def _seqs(lengths: list[int], device: str = "cpu") -> PackedSeqs:
    return PackedSeqs.from_position_ids(torch.cat([torch.arange(n) for n in lengths])[None].to(device))


def _qkv(total: int, device: str = "cpu", dtype: torch.dtype = torch.float32):
    g = torch.Generator(device=device).manual_seed(0)
    return tuple(torch.randn(total, h, 32, device=device, dtype=dtype, generator=g).requires_grad_() for h in (4, 2, 2))


def _masked_reference(q, k, v, seqs):  # noqa: ANN001, ANN202
    mask = document_causal_mask(seqs)
    out = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


def test_uniform_docs():
    assert uniform_docs(_seqs([64]))
    assert uniform_docs(_seqs([16, 16, 16, 16]))
    assert not uniform_docs(_seqs([16, 48]))


@pytest.mark.parametrize("lengths", [[64], [16, 16, 16, 16]])
def test_dense_matches_block_diagonal_mask(lengths):
    q, k, v = _qkv(sum(lengths))
    seqs = _seqs(lengths)
    grad = torch.randn_like(q)
    out = dense_causal_attention(q, k, v, seqs.num_docs)
    ref = _masked_reference(q, k, v, seqs)
    torch.testing.assert_close(out, ref)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("lengths", [[16, 16, 16, 16], [10, 30, 24]])
def test_backends_agree_uniform_and_uneven(lengths):
    q, k, v = _qkv(sum(lengths))
    seqs = _seqs(lengths)
    ref = _masked_reference(q, k, v, seqs)
    torch.testing.assert_close(SDPAAttention()(q, k, v, seqs), ref)
    torch.testing.assert_close(VarlenAttention(sdpa_fallback=True)(q, k, v, seqs), ref)


def test_adamw_foreach_on_cpu():
    opt = build_optimizer(AdamWConfig(), [torch.nn.Parameter(torch.zeros(4))])
    assert opt.defaults["foreach"] and not opt.defaults["fused"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_dense_cudnn_matches_flash_and_adamw_fused():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lengths = [512, 512]
    q, k, v = _qkv(sum(lengths), "cuda", torch.bfloat16)
    seqs = _seqs(lengths, "cuda")
    grad = torch.randn_like(q)
    out = dense_causal_attention(q, k, v, seqs.num_docs)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # (2, H, 512, D) batch, flash only
        qb, kb, vb = (x.view(2, 512, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        ref = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
        ref = ref.transpose(1, 2).reshape(q.shape)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
    opt = build_optimizer(AdamWConfig(), [torch.nn.Parameter(torch.zeros(4, device="cuda"))])
    assert opt.defaults["fused"] and not opt.defaults["foreach"]
