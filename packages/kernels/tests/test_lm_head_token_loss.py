"""fused_token_loss (a per-token loss's gradients formed in the forward, RL's head) against autograd in float64."""

import pytest
import torch

from prime_rl.kernels import IGNORE_INDEX, fused_token_loss


def _inputs(T, H, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    targets = torch.randint(0, V, (T,), generator=g)
    targets[::5] = IGNORE_INDEX
    # what an RL loss reads beside the logprob: inference's logprob and the advantage of each token
    old = torch.randn(T, generator=g) * 0.5 - 4.0
    adv = torch.randn(T, generator=g)
    return hidden, weight, targets, old, adv


def _ratio_loss(old, adv, low=0.5, high=2.0):
    """An importance-ratio loss as RL's: -r_t A_t, masked where r_t leaves [low, high] (depends on the logprob)."""

    def loss(lp, t0, t1):
        ratio = torch.exp(lp - old[t0:t1].to(lp.dtype))
        keep = (ratio > low) & (ratio < high)
        return torch.where(keep, -ratio * adv[t0:t1].to(lp.dtype), torch.zeros_like(ratio)).sum()

    return loss


def _reference(hidden, weight, targets, temperature, token_loss, upstream):
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    logp = torch.log_softmax(h @ w.T / temperature, dim=-1)
    valid = targets >= 0
    safe = torch.where(valid, targets, 0)
    lp = torch.where(valid, logp.gather(1, safe[:, None]).squeeze(1), 0.0)
    entropy = -(logp.exp() * logp).sum(-1)
    loss = token_loss(lp, 0, lp.shape[0])
    (loss * upstream).backward()
    return loss.detach(), lp.detach(), entropy.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_loss_logprobs_entropy_and_gradients_match_float64(dtype, tol, temperature):
    hidden, weight, targets, old, adv = _inputs(37, 16, 90, dtype)  # chunks of 8: a ragged last chunk
    token_loss = _ratio_loss(old, adv)
    upstream = 0.37  # the RL loop divides by the step's loss tokens
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, lp, entropy = fused_token_loss(h, w, targets, token_loss, temperature=temperature, chunk_size=8)
    (loss * upstream).backward()
    ref_loss, ref_lp, ref_entropy, ref_h, ref_w = _reference(hidden, weight, targets, temperature, token_loss, upstream)
    assert loss.dtype == lp.dtype == entropy.dtype == torch.float32
    assert not lp.requires_grad and not entropy.requires_grad
    for got, ref in ((loss, ref_loss), (lp, ref_lp), (entropy, ref_entropy), (h.grad, ref_h), (w.grad, ref_w)):
        torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
    # the ratio mask is live: some tokens are masked, some are not (else this is the NLL test again)
    ratio = torch.exp(ref_lp - old)
    assert ((ratio > 0.5) & (ratio < 2.0)).any() and ((ratio <= 0.5) | (ratio >= 2.0)).any()


def test_chunks_cover_the_tokens_in_order_and_do_not_change_the_result():
    hidden, weight, targets, old, adv = _inputs(40, 8, 50, torch.float32)
    results = []
    for chunk in (1, 7, 40, 1000):
        seen = []

        def token_loss(lp, t0, t1, seen=seen):
            seen.append((t0, t1))
            return _ratio_loss(old, adv)(lp, t0, t1)

        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, lp, entropy = fused_token_loss(h, w, targets, token_loss, chunk_size=chunk)
        loss.backward()
        assert [t for r in seen for t in r] == sorted(t for r in seen for t in r) and seen[0][0] == 0
        assert seen[-1][1] == 40 and all(a[1] == b[0] for a, b in zip(seen, seen[1:]))
        results.append((loss, lp, entropy, h.grad, w.grad))
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            torch.testing.assert_close(a, b)


def test_a_loss_without_the_logprobs_passes_no_gradient():
    """A micro-batch whose every token is masked still runs: loss 0, zero gradients, logprobs reported."""
    hidden, weight, targets, _, _ = _inputs(9, 8, 20, torch.float32)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, lp, _ = fused_token_loss(h, w, targets, lambda lp, t0, t1: torch.zeros((), dtype=lp.dtype), chunk_size=4)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(w.grad) == 0
    assert torch.count_nonzero(lp) > 0


def test_saved_tensor_hooks_never_see_the_gradients_formed_in_the_forward():
    """Activation offloading packs what autograd saves; the fused heads keep their gradients for the start of
    backward, so a copy to the host and back would be pure cost (622 MB of weight gradient at Qwen3's vocab)."""
    from prime_rl.kernels import fused_nll_sum

    hidden, weight, targets, old, adv = _inputs(9, 8, 20, torch.float32)
    packed = []
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t, lambda t: t):
        loss = fused_token_loss(h, w, targets, _ratio_loss(old, adv), chunk_size=4)[0] + fused_nll_sum(h, w, targets)
    loss.backward()
    # only the per-chunk loss's own [c] tensors (autograd for g_t, inside the forward and gone with it)
    assert all(len(shape) == 1 and shape[0] <= 4 for shape in packed), packed
    assert h.grad is not None and w.grad is not None


def test_the_nll_as_a_token_loss_is_fused_nll_sum():
    from prime_rl.kernels import fused_nll_sum

    hidden, weight, targets, _, _ = _inputs(21, 8, 30, torch.float32)
    grads = []
    for head in ("nll", "token"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if head == "nll":
            loss = fused_nll_sum(h, w, targets, temperature=0.7, chunk_size=6)
        else:
            loss, *_ = fused_token_loss(h, w, targets, lambda lp, t0, t1: -lp.sum(), temperature=0.7, chunk_size=6)
        loss.backward()
        grads.append((loss, h.grad, w.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
def test_cuda_matches_the_torch_path():
    hidden, weight, targets, old, adv = _inputs(3000, 256, 5000, torch.bfloat16)
    results = []
    for device in ("cpu", "cuda"):
        h, w = hidden.detach().to(device).requires_grad_(), weight.detach().to(device).requires_grad_()
        token_loss = _ratio_loss(old.to(device), adv.to(device), low=0.0, high=float("inf"))
        loss, lp, entropy = fused_token_loss(h, w, targets.to(device), token_loss, temperature=0.7, chunk_size=1024)
        loss.backward()
        results.append([t.float().cpu() for t in (loss, lp, entropy, h.grad, w.grad)])
    # bf16 logits and a bf16 weight gradient summed over 3 chunks in a different order: compare whole tensors
    for name, cpu, cuda in zip(("loss", "logprobs", "entropy", "grad_hidden", "grad_weight"), *results):
        rel = ((cuda - cpu).norm() / cpu.norm()).item()
        assert rel < 1e-2, f"{name}: relative error {rel:.2e}"
