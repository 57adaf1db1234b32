"""Chunked torch LM head vs a float64 reference (values and gradients), on CPU."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prime_rl.kernels import IGNORE_INDEX, fused_logprobs_entropy, fused_logprobs_entropy_torch

_spec = importlib.util.spec_from_file_location("lm_head_cases", Path(__file__).with_name("lm_head_cases.py"))
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_float64_reference(dtype, temperature):
    # T=50 is not a multiple of chunk 16; V=300 is not a multiple of vocab block 64.
    cases.check_case(
        fused_logprobs_entropy_torch, cases.fresh_seed(), 50, 32, 300, dtype, temperature, chunk_size=16, vocab_block=64
    )


def test_ignored_targets_and_dispatch():
    cases.check_case(fused_logprobs_entropy, cases.fresh_seed(), 41, 24, 130, torch.float32, 1.3, ignore_every=3)


def test_ignored_target_has_zero_logprob_and_no_gradient():
    hidden, weight, targets, _, _ = cases.make_inputs(cases.fresh_seed(), 12, 16, 50, torch.float32)
    targets[:] = IGNORE_INDEX
    h = hidden.clone().requires_grad_()
    lp, _ = fused_logprobs_entropy_torch(h, weight, targets, chunk_size=5, vocab_block=16)
    assert torch.equal(lp, torch.zeros_like(lp))
    lp.sum().backward()
    assert torch.equal(h.grad, torch.zeros_like(h.grad))


def test_sft_cross_entropy_equals_torch():
    hidden, weight, targets, _, _ = cases.make_inputs(cases.fresh_seed(), 40, 16, 70, torch.float32, ignore_every=4)
    h1 = hidden.clone().requires_grad_()
    lp, _ = fused_logprobs_entropy_torch(h1, weight, targets, chunk_size=16, vocab_block=32)
    loss = -lp.sum() / (targets >= 0).sum()
    loss.backward()
    h2 = hidden.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(h2 @ weight.T, targets, ignore_index=IGNORE_INDEX)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-4, atol=1e-6)


def test_grad_only_for_weight_and_only_logprobs_used():
    hidden, weight, targets, _, _ = cases.make_inputs(cases.fresh_seed(), 20, 8, 33, torch.float64)
    w = weight.clone().requires_grad_()
    lp, _ = fused_logprobs_entropy_torch(hidden, w, targets, chunk_size=7, vocab_block=10)
    lp.sum().backward()
    w_ref = weight.clone().requires_grad_()
    ref = torch.log_softmax(hidden @ w_ref.T, -1).gather(1, targets[:, None]).sum()
    ref.backward()
    torch.testing.assert_close(w.grad, w_ref.grad)


def test_zero_tokens():
    h = torch.randn(0, 8, requires_grad=True)
    w = torch.randn(20, 8, requires_grad=True)
    lp, ent = fused_logprobs_entropy(h, w, torch.zeros(0, dtype=torch.int64))
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=0.0), "temperature"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(targets=torch.tensor([0, 1, 99])), "vocab size"),
        (dict(backend="cuda"), "backend"),
    ],
)
def test_bad_inputs_are_rejected(kwargs, match):
    args = dict(hidden=torch.randn(3, 4), weight=torch.randn(10, 4), targets=torch.tensor([0, 1, 2]))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        fused_logprobs_entropy(**args)


def test_triton_kernels_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = Path(__file__).with_name("lm_head_cases.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 4, proc.stdout
