"""Shared checks for the LM-head tests: a float64 reference and one comparison routine.

Imported by the test modules, and run as a script (`python lm_head_cases.py`) under
TRITON_INTERPRET=1 to exercise the Triton kernels on CPU in a fresh process.
"""

import os
import sys

import torch

from prime_rl.kernels import vanilla_logprobs_entropy

# Tolerances on values (abs) and on gradients (max abs error / max abs value), per input dtype.
TOL = {torch.float32: (2e-4, 2e-4), torch.bfloat16: (2e-4, 2e-2)}


def fresh_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item()) ^ int.from_bytes(os.urandom(4), "little")


def make_inputs(seed: int, T: int, H: int, V: int, dtype: torch.dtype, device: str = "cpu", ignore_every: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * (2.0 / H**0.5)).to(dtype)  # logits of O(1-3): a peaked softmax
    targets = torch.randint(0, V, (T,), generator=g)
    if ignore_every:
        targets[::ignore_every] = -100
    grad_lp = torch.randn(T, generator=g, dtype=torch.float64)
    grad_ent = torch.randn(T, generator=g, dtype=torch.float64)
    return [x.to(device) for x in (hidden, weight, targets, grad_lp, grad_ent)]


def reference(hidden, weight, targets, temperature, grad_lp, grad_ent):
    """float64 logprobs, entropy and gradients of sum(a*logprobs + b*entropy) on the same (rounded) inputs."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    lp, ent = vanilla_logprobs_entropy(h, w, targets, temperature)
    (grad_lp.double() * lp + grad_ent.double() * ent).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def check_case(fn, seed: int, T: int, H: int, V: int, dtype: torch.dtype, temperature: float, device="cpu", **kw):
    hidden, weight, targets, grad_lp, grad_ent = make_inputs(seed, T, H, V, dtype, device, kw.pop("ignore_every", 0))
    ref_lp, ref_ent, ref_gh, ref_gw = reference(hidden, weight, targets, temperature, grad_lp, grad_ent)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ent = fn(h, w, targets, temperature, **kw)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32, (lp.dtype, ent.dtype)
    assert lp.shape == (T,) and ent.shape == (T,)
    (grad_lp.float() * lp + grad_ent.float() * ent).sum().backward()
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    val_tol, grad_tol = TOL[dtype]
    ctx = f"seed={seed} T={T} H={H} V={V} dtype={dtype} temperature={temperature} {kw}"
    for name, got, want in [("logprobs", lp, ref_lp), ("entropy", ent, ref_ent)]:
        err = (got.double() - want).abs().max().item()
        assert err < val_tol * max(1.0, want.abs().max().item()), f"{name} max err {err:.3g}; {ctx}"
    for name, got, want in [("grad hidden", h.grad, ref_gh), ("grad weight", w.grad, ref_gw)]:
        rel = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert rel < grad_tol, f"{name} relative err {rel:.3g} > {grad_tol}; {ctx}"


if __name__ == "__main__":
    # Run the Triton kernels in the interpreter: python lm_head_cases.py (sets TRITON_INTERPRET itself).
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    import prime_rl.kernels.lm_head.triton_impl as triton_impl

    triton_impl.DLOGITS_BUFFER_ELEMENTS = 40 * 256  # several vocab blocks at this small V
    for dtype in (torch.float32, torch.bfloat16):
        for T, V, temperature, chunk in [(70, 301, 0.7, 40), (33, 200, 1.0, 8192)]:
            seed = fresh_seed()
            check_case(
                triton_impl.fused_logprobs_entropy_triton, seed, T, 48, V, dtype, temperature,
                chunk_size=chunk, ignore_every=7,
            )  # fmt: skip
            print(f"ok dtype={dtype} T={T} V={V} temperature={temperature} chunk={chunk} seed={seed}")
    sys.exit(0)
