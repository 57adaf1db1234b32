"""GPU: Nemotron-H's relu^2 experts on the Triton grouped GEMM agree with the per-expert loop, and the
model on CUDA keeps its packed-sequence semantics and transformers parity."""

from __future__ import annotations

import pytest
import torch

from prime_rl.trainer.models import build_model, load_hf_weights
from prime_rl.trainer.models.nemotron_h import grouped_relu2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_grouped_relu2_triton_matches_the_loop():
    pytest.importorskip("triton")
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([64, 0, 200, 33, 1], device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w_up = (torch.randn(5, 192, 256, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05).requires_grad_()
    w_down = (torch.randn(5, 256, 192, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05).requires_grad_()
    out = grouped_relu2(x, counts, w_up, w_down)  # Triton: bf16 on CUDA
    grads = torch.autograd.grad(out.float().square().sum(), (x, w_up, w_down))
    args = [t.detach().float().requires_grad_() for t in (x, w_up, w_down)]
    ref = grouped_relu2(args[0], counts, args[1], args[2])  # fp32: the per-expert loop
    ref_grads = torch.autograd.grad(ref.square().sum(), args)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    for got, want in zip(grads, ref_grads, strict=True):
        assert ((got.float() - want).norm() / want.norm()).item() < 2e-2


def test_cuda_packed_rows_match_transformers_per_document(tmp_path):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(0)
    config = NemotronHConfig(
        vocab_size=256, hidden_size=128, hybrid_override_pattern="ME*M-E", num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=256, mamba_num_heads=8, mamba_head_dim=32,
        ssm_state_size=32, n_groups=2, chunk_size=64, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, moe_shared_expert_intermediate_size=96,
    )  # fmt: skip
    config._attn_implementation = "eager"
    hf = NemotronHForCausalLM(config).float().eval()
    hf.save_pretrained(tmp_path)
    hf = hf.cuda()
    ours = build_model(tmp_path, attn="sdpa", dtype=torch.float32, device="cuda")
    load_hf_weights(ours, tmp_path)
    lengths = [100, 64, 1, 150, 69]  # a document starting exactly on a chunk boundary, a 1-token one
    ids = torch.randint(0, 256, (1, sum(lengths)), device="cuda")
    pos = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    with torch.no_grad():
        logits = ours.lm_head(ours(ids, pos))[0]
        ref = torch.cat([hf(input_ids=d[None]).logits[0] for d in ids[0].split(lengths)])
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
