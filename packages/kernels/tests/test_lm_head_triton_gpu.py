"""Triton LM head on CUDA vs a float64 reference, plus a peak-memory check. Run on the GPU machine."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from prime_rl.kernels import fused_logprobs_entropy  # noqa: E402

_spec = importlib.util.spec_from_file_location("lm_head_cases", Path(__file__).with_name("lm_head_cases.py"))
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [8192, 384])
def test_triton_matches_float64_reference(dtype, temperature, chunk_size):
    # T=1000 is not a multiple of the token tile or chunk 384; V=5003 is not a multiple of any vocab tile.
    cases.check_case(
        fused_logprobs_entropy, cases.fresh_seed(), 1000, 256, 5003, dtype, temperature, device="cuda",
        chunk_size=chunk_size, backend="triton", ignore_every=9,
    )  # fmt: skip


def test_torch_backend_on_cuda():
    cases.check_case(
        fused_logprobs_entropy, cases.fresh_seed(), 300, 64, 1000, torch.float32, 0.9, device="cuda",
        chunk_size=128, backend="torch",
    )  # fmt: skip


def test_extra_peak_memory_stays_small():
    T, H, V = 4096, 1024, 151936  # a [T, V] float32 logits tensor alone would be 2.3 GiB
    hidden, weight, targets, _, _ = cases.make_inputs(cases.fresh_seed(), T, H, V, torch.bfloat16, "cuda")
    hidden.requires_grad_()
    weight.requires_grad_()
    # Warm up first: Triton's autotuner allocates its own 256 MB cache-flush buffer on the first call.
    lp, ent = fused_logprobs_entropy(hidden, weight, targets)
    (lp.sum() + ent.sum()).backward()
    hidden.grad = weight.grad = None
    del lp, ent
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = fused_logprobs_entropy(hidden, weight, targets)
    (lp.sum() + ent.sum()).backward()
    torch.cuda.synchronize()
    extra_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
    grads_gib = (weight.numel() + hidden.numel()) * 2 / 2**30
    assert extra_gib < grads_gib + 0.5, f"extra peak {extra_gib:.2f} GiB, gradients alone {grads_gib:.2f} GiB"
