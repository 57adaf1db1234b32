"""Blockwise-FP8 Triton grouped GEMM on the GPU against float64, at the issue's shapes: a Qwen3-30B-A3B
layer (128 experts, top-8 of 16,384 tokens, H 2048, I 768) and one EP=8 rank's 16 experts."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

_spec = importlib.util.spec_from_file_location(
    "grouped_gemm_fp8_cases", Path(__file__).with_name("grouped_gemm_fp8_cases.py")
)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


def _routed_counts(experts: int, tokens: int, top_k: int = 8) -> list[int]:
    """Random top-k routing, as benchmarks/moe_compute.py draws it."""
    g = torch.Generator().manual_seed(0)
    topk = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices.reshape(-1)
    return torch.bincount(topk, minlength=experts).tolist()


def test_quantizers_match_torch_reference_bit_for_bit():
    cases.check_quantizers("cuda")


@pytest.mark.parametrize("experts,tokens", [(128, 16384), (16, 2048)], ids=["128x-top8", "16x-top8"])
@pytest.mark.parametrize("k,n", [(2048, 768), (768, 2048)], ids=["gate_up", "down"])
def test_fp8_grouped_mm_matches_float64_of_the_quantized_math(experts, tokens, k, n):
    counts = _routed_counts(experts, tokens)
    counts[1], counts[2] = 0, counts[2] + counts[1]  # an expert without tokens; random counts end in partial tiles
    cases.check_same_math(counts, k, n, "cuda", torch.bfloat16)


def test_fp8_swiglu_error_against_unquantized_is_within_bound():
    counts = _routed_counts(16, 512)
    print(cases.accuracy_vs_unquantized(counts, 2048, 768, "cuda"))


def test_fp8_swiglu_compiles_fullgraph():
    from prime_rl.kernels.grouped_gemm.fp8_op import fp8_grouped_swiglu_triton

    counts = torch.tensor([40, 0, 300, 3], device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(343, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    ws = [torch.randn(4, 128, 256, device="cuda", generator=g, dtype=torch.bfloat16) / 16 for _ in range(2)]
    ws.append(torch.randn(4, 256, 128, device="cuda", generator=g, dtype=torch.bfloat16) / 11)
    compiled = torch.compile(fp8_grouped_swiglu_triton, fullgraph=True)
    torch.testing.assert_close(compiled(x, counts, *ws), fp8_grouped_swiglu_triton(x, counts, *ws))
