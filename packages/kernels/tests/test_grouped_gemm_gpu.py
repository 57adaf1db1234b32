"""Triton grouped GEMM on the GPU against the float64 per-expert loop, at MoE-like shapes."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

_spec = importlib.util.spec_from_file_location("grouped_gemm_cases", Path(__file__).with_name("grouped_gemm_cases.py"))
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "counts,hidden,inter",
    [
        ([300, 0, 517, 64, 1, 0, 900, 131], 1024, 768),  # ragged, empty experts, K/N tile multiples
        ([0, 77, 0, 250], 200, 136),  # sizes that are not tile multiples
        ([0, 0, 0, 0], 256, 128),  # nothing routed here
    ],
)
def test_triton_grouped_swiglu_matches_reference(counts, hidden, inter, dtype):
    cases.check_case(counts, hidden, inter, dtype, "cuda")


def test_moe_layer_uses_triton_and_compiles_fullgraph():
    """The model's MoE layer goes through the custom op and compiles as one graph."""
    from prime_rl.kernels.grouped_gemm import grouped_swiglu, grouped_swiglu_loop

    counts, leaves, _ = cases.make_inputs([40, 0, 88, 3], 256, 128, torch.bfloat16, "cuda")
    compiled = torch.compile(grouped_swiglu, fullgraph=True)
    out = compiled(leaves[0], counts, *leaves[1:])
    ref = grouped_swiglu_loop(leaves[0].float(), counts, *(w.float() for w in leaves[1:]))
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)
