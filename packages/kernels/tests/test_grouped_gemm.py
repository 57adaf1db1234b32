"""Grouped SwiGLU: the per-expert loop against dense math, and the Triton kernels in the interpreter."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from prime_rl.kernels.grouped_gemm import grouped_swiglu, grouped_swiglu_loop


def test_loop_matches_per_token_math_and_keeps_every_weight_in_the_graph():
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(int(counts.sum()), 16)
    wg, wu = torch.randn(4, 8, 16, requires_grad=True), torch.randn(4, 8, 16, requires_grad=True)
    wd = torch.randn(4, 16, 8, requires_grad=True)
    expert = torch.repeat_interleave(torch.arange(4), counts)
    ref = torch.stack([(F.silu(wg[e] @ t) * (wu[e] @ t)) @ wd[e].t() for t, e in zip(x, expert, strict=True)])
    out = grouped_swiglu(x, counts, wg, wu, wd)  # CPU: the loop
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    empty = grouped_swiglu_loop(x[:0], torch.zeros(4, dtype=torch.long), wg, wu, wd)
    grads = torch.autograd.grad(empty.sum(), [wg, wu, wd])
    assert empty.shape == (0, 16) and all(g.abs().sum() == 0 for g in grads)


def test_triton_kernels_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = Path(__file__).with_name("grouped_gemm_cases.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 9, proc.stdout
