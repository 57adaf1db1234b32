"""GPU: varlen / flex / flash-attn backends agree with SDPA on packed input, forward and backward."""

from __future__ import annotations

import pytest
import torch

from prime_rl.trainer.models import PackedSeqs, build_model, load_hf_weights, resolve_attn
from prime_rl.trainer.models.attention import SDPAAttention, build_core_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LENGTHS = [100, 517, 1, 300, 106]  # 1024 tokens; uneven lengths, a 1-token document


def _backends() -> list[str]:
    names = ["varlen", "flex"]
    for name in ("flash_attention_2", "flash_attention_3", "flash_attention_4"):
        try:
            resolve_attn(name)
            names.append(name)
        except ImportError:
            pass
    return names


def _qkv(num_heads=8, num_kv_heads=2, head_dim=128):
    g = torch.Generator(device="cuda").manual_seed(0)
    total = sum(LENGTHS)
    q, k, v = (
        torch.randn(total, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        for h in (num_heads, num_kv_heads, num_kv_heads)
    )
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None].cuda()
    return q, k, v, PackedSeqs.from_position_ids(position_ids)


@pytest.mark.parametrize("attn", _backends())
def test_core_attention_matches_sdpa_packed(attn):
    q, k, v, seqs = _qkv()
    grad_out = torch.randn_like(q)
    outs, grads = {}, {}
    for name, module in (("sdpa", SDPAAttention()), (attn, build_core_attention(attn))):
        out = module(q, k, v, PackedSeqs.from_position_ids(seqs.position_ids[None]))
        (dq, dk, dv) = torch.autograd.grad(out, (q, k, v), grad_out)
        outs[name], grads[name] = out.float(), (dq.float(), dk.float(), dv.float())
    torch.testing.assert_close(outs[attn], outs["sdpa"], atol=2e-2, rtol=2e-2)
    for got, ref in zip(grads[attn], grads["sdpa"]):
        torch.testing.assert_close(got, ref, atol=5e-2, rtol=5e-2)


def test_varlen_model_matches_sdpa_model_and_one_by_one(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    )  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    models = {}
    for attn in ("sdpa", "varlen", "auto"):
        models[attn] = build_model(tmp_path, attn=attn, dtype=torch.bfloat16, device="cuda")
        load_hf_weights(models[attn], tmp_path)
    total = sum(LENGTHS)
    input_ids = torch.randint(0, 256, (1, total), device="cuda")
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None].cuda()
    with torch.no_grad():
        ref = models["sdpa"](input_ids, position_ids).float()
        out = models["varlen"](input_ids, position_ids).float()
        auto = models["auto"](input_ids, position_ids).float()
        singles = torch.cat(
            [models["varlen"](i, p) for i, p in zip(input_ids.split(LENGTHS, 1), position_ids.split(LENGTHS, 1))], 1
        ).float()
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(auto, ref, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out, singles, atol=3e-2, rtol=3e-2)
    # fp32 under attn="auto" falls back to SDPA instead of failing in the varlen kernel.
    fp32 = build_model(tmp_path, attn="auto", dtype=torch.float32, device="cuda")
    load_hf_weights(fp32, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(fp32(input_ids, position_ids), ref, atol=5e-2, rtol=5e-2)
