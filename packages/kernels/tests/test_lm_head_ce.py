"""fused_nll_sum (the SFT cross-entropy head, gradients in the forward) against autograd in float64."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from prime_rl.kernels import IGNORE_INDEX, fused_nll_sum
from prime_rl.kernels.lm_head.cross_entropy import ce_rows_torch, default_chunk_size


def _inputs(T, H, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    targets = torch.randint(0, V, (T,), generator=g)
    targets[::4] = IGNORE_INDEX
    return hidden, weight, targets


def _reference(hidden, weight, targets, temperature, upstream):
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    logp = torch.log_softmax(h @ w.T / temperature, dim=-1)
    valid = targets >= 0
    loss = -logp[valid].gather(1, targets[valid][:, None]).sum()
    (loss * upstream).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_loss_and_gradients_match_float64(dtype, tol, temperature):
    hidden, weight, targets = _inputs(37, 16, 90, dtype)  # 37 tokens in chunks of 8: a ragged last chunk
    upstream = 0.37  # the SFT loop scales the sum by 1 / loss tokens
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_nll_sum(h, w, targets, temperature=temperature, chunk_size=8)
    (loss * upstream).backward()
    ref_loss, ref_h, ref_w = _reference(hidden, weight, targets, temperature, upstream)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss, rtol=tol, atol=tol)
    torch.testing.assert_close(h.grad.double(), ref_h, rtol=tol, atol=tol)
    torch.testing.assert_close(w.grad.double(), ref_w, rtol=tol, atol=tol)


def test_ignored_tokens_contribute_nothing():
    hidden, weight, targets = _inputs(12, 8, 30, torch.float32)
    targets[:] = IGNORE_INDEX
    h = hidden.clone().requires_grad_()
    loss = fused_nll_sum(h, weight.clone().requires_grad_(), targets, chunk_size=5)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(h.grad) == 0


def test_chunk_size_does_not_change_the_result():
    hidden, weight, targets = _inputs(40, 8, 50, torch.float32)
    results = []
    for chunk in (1, 7, 40, 1000):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fused_nll_sum(h, w, targets, chunk_size=chunk)
        loss.backward()
        results.append((loss, h.grad, w.grad))
    for loss, gh, gw in results[1:]:
        torch.testing.assert_close(loss, results[0][0])
        torch.testing.assert_close(gh, results[0][1])
        torch.testing.assert_close(gw, results[0][2])


def test_default_chunk_bounds_the_logits_buffer():
    assert default_chunk_size(151936, 2) == 512  # 512 x 151936 bf16 = 148 MiB <= 256 MiB
    assert default_chunk_size(151936, 4) == 256
    assert default_chunk_size(10**9, 2) == 16
    # long rows: about as many logits as hidden states (65536 x 2048 / 151936 = 884 -> 1024 tokens)
    assert default_chunk_size(151936, 2, tokens=65536, hidden=2048) == 1024
    assert default_chunk_size(151936, 2, tokens=16384, hidden=2048) == 512


def test_backward_scales_the_gradients_by_the_upstream_gradient():
    hidden, weight, targets = _inputs(10, 8, 20, torch.float32)
    grads = []
    for upstream in (1.0, -2.5):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        (fused_nll_sum(h, w, targets, chunk_size=3) * upstream).backward()
        grads.append((h.grad, w.grad))
    torch.testing.assert_close(grads[1][0], -2.5 * grads[0][0])
    torch.testing.assert_close(grads[1][1], -2.5 * grads[0][1])


def test_a_second_backward_is_refused_not_wrong():
    hidden, weight, targets = _inputs(6, 8, 20, torch.float32)
    loss = fused_nll_sum(hidden.clone().requires_grad_(), weight, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_bad_chunk_size_names_the_value():
    hidden, weight, targets = _inputs(4, 8, 10, torch.float32)
    with pytest.raises(ValueError, match="chunk_size=0"):
        fused_nll_sum(hidden, weight, targets, chunk_size=0)


def test_triton_row_pass_matches_torch_in_the_interpreter():
    """The CUDA row kernel, run by Triton's interpreter on CPU in a fresh process, with and without its entropy
    output (the NLL head reads none, the token-loss head reports it)."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch
        from prime_rl.kernels.lm_head.cross_entropy import ce_rows_torch
        from prime_rl.kernels.lm_head.triton_kernels import ce_rows_triton
        g = torch.Generator().manual_seed(1)
        for dtype in (torch.float32, torch.bfloat16):
            z = (torch.randn(6, 150, generator=g) * 3).to(dtype)
            t = torch.tensor([0, 149, -100, 75, 3, 64])
            for with_entropy in (False, True):
                a, b = z.clone(), z.clone()
                ent_ref, ent = (torch.empty(6), torch.full((6,), float("nan"))) if with_entropy else (None, None)
                lp_ref, lp = ce_rows_torch(a, t, 1 / 0.7, ent_ref), ce_rows_triton(b, t, 1 / 0.7, ent)
                torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(b.float(), a.float(), rtol=1e-2, atol=1e-5)
                assert torch.count_nonzero(b[2]) == 0
                if with_entropy:
                    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)
                    assert bool((ent_ref > 0).all())
        print("ok")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


@pytest.mark.gpu
def test_cuda_matches_the_torch_path():
    hidden, weight, targets = _inputs(3000, 256, 5000, torch.bfloat16)
    results = []
    for device in ("cpu", "cuda"):
        h, w = hidden.detach().to(device).requires_grad_(), weight.detach().to(device).requires_grad_()
        loss = fused_nll_sum(h, w, targets.to(device), temperature=0.7, chunk_size=1024)
        loss.backward()
        results.append([t.float().cpu() for t in (loss, h.grad, w.grad)])
    # bf16 logits and a bf16 weight gradient summed over 3 chunks in a different order: compare whole
    # tensors (a wrong row or a missing chunk is a large relative error; rounding is ~1e-3)
    for name, cpu, cuda in zip(("loss", "grad_hidden", "grad_weight"), *results):
        rel = ((cuda - cpu).norm() / cpu.norm()).item()
        assert rel < 1e-2, f"{name}: relative error {rel:.2e}"


def test_torch_row_pass_writes_softmax_minus_onehot():
    z = torch.tensor([[0.0, 1.0, 2.0]])
    lp = ce_rows_torch(z, torch.tensor([2]), 1.0)
    p = torch.softmax(torch.tensor([0.0, 1.0, 2.0]), 0)
    torch.testing.assert_close(lp, torch.log(p[2:3]))
    torch.testing.assert_close(z[0], p - torch.tensor([0.0, 0.0, 1.0]))
