"""Benchmark: fused LM heads (RL: logprob + entropy, and the token-ratio loss through `fused_token_loss`; SFT:
`fused_nll_sum`), forward + backward, vs the vanilla head
and, when `liger_kernel` is importable, Liger's fused linear cross-entropy in the same process.

Prints one JSON object per line. Measures like ../shared/bench/anchor_hf_train.py `lm_head()`:
inputs created, base = allocated memory, 2 warm-up steps, peak stats reset, 5 timed steps (the mean of 5 steps
taken `--repeats` times, default 3, and the median reported: the anchor runs it once); "extra peak"
is peak allocated minus base (so it includes the hidden and weight gradients, 0.64 GiB at T=16384).
Each step is forward + backward of logprobs.sum() + entropy.sum().

    python benchmarks/lm_head.py [--tokens 16384 65536] [--anchor path/to/anchor_hf_train.py] [--profile token_loss]

With --profile HEAD..., each named head's forward + backward at the largest --tokens runs once more under
torch.profiler: one JSON row per head with its kernels' device time by name (the top 12, and the rest summed),
to say where the milliseconds of one head beyond another's go.

With --anchor, the anchor's own lm_head() runs first in the same process, so the ratio printed at
the end is against the anchor measured on the same machine in the same run.
"""

import argparse
import contextlib
import importlib.util
import io
import json
import statistics
import time

import torch

from prime_rl.kernels import fused_logprobs_entropy, fused_nll_sum, fused_token_loss, vanilla_logprobs_entropy


def head_step(fn, tokens: int, hidden: int, vocab: int, chunk_size: int):
    """Inputs of one head (seeded, bf16, on the GPU) and its forward + backward step: ``(step, h, w, tgt)``."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_()
    tgt = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)

    def step():
        out = fn(h, w, tgt, chunk_size)
        loss = out if isinstance(out, torch.Tensor) else out[0].sum() + out[1].sum()  # CE heads return the loss
        loss.backward()

    return step, h, w, tgt


def bench(fn, tokens: int, hidden: int, vocab: int, chunk_size: int, repeats: int = 1) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step, h, w, tgt = head_step(fn, tokens, hidden, vocab, chunk_size)
    base = torch.cuda.max_memory_allocated()
    try:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        runs = []
        for _ in range(repeats):  # the anchor's mean of 5 steps, `repeats` times: the median is what is reported
            t = time.perf_counter()
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            runs.append((time.perf_counter() - t) / 5 * 1e3)
        ms = statistics.median(runs)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        # Forward alone, for the breakdown.
        with torch.no_grad():
            fn(h, w, tgt, chunk_size)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(5):
                fn(h, w, tgt, chunk_size)
            torch.cuda.synchronize()
            fwd_ms = (time.perf_counter() - t) / 5 * 1e3
        out = dict(ms=round(ms, 2), fwd_ms=round(fwd_ms, 2), peak_extra_gib=round(peak, 3))
        return out if repeats == 1 else dict(out, ms_runs=[round(r, 2) for r in runs])
    except torch.OutOfMemoryError as e:
        return dict(error="OOM", detail=str(e).splitlines()[0][:200])


def vanilla(h, w, tgt, chunk_size):
    return vanilla_logprobs_entropy(h, w, tgt)


def fused(h, w, tgt, chunk_size):
    return fused_logprobs_entropy(h, w, tgt, chunk_size=chunk_size)


def nll_sum(h, w, tgt, chunk_size):
    return fused_nll_sum(h, w, tgt)  # SFT's head: its own chunk (logits buffer <= 256 MiB)


def nll_sum_liger_chunk(h, w, tgt, chunk_size):
    """SFT's head at Liger's chunk rule (the power of two at or above T * H / V rows, no 256 MiB floor): its memory
    at 16k tokens (a [256, V] buffer, not [512, V]), to show the speed at equal memory; the default keeps the
    floor for speed at small T (every chunk reads and writes the whole [V, H] weight gradient once)."""
    rows = -(-h.shape[0] * h.shape[1] // w.shape[0])
    return fused_nll_sum(h, w, tgt, chunk_size=max(16, 1 << (rows - 1).bit_length()))


def token_loss(h, w, tgt, chunk_size):
    """RL's default head: the token-ratio loss given to the head (gradient formed in the forward), its own chunk."""
    old = torch.full(tgt.shape, -12.0, device=tgt.device)  # inference's logprobs (about -log V at init)
    adv = torch.linspace(-1.0, 1.0, tgt.shape[0], device=tgt.device)

    def loss(lp, t0, t1):
        ratio = torch.exp(lp - old[t0:t1])
        keep = (ratio > 0.125) & (ratio < 8.0)
        return torch.where(keep, -ratio * adv[t0:t1], 0.0).sum()

    return fused_token_loss(h, w, tgt, loss)[0]


def liger_flce(h, w, tgt, chunk_size):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(reduction="sum")(w, h, tgt)


def agreement(tokens: int, hidden: int, vocab: int) -> dict:
    """Max difference between fused (fp32 logits) and vanilla (bf16-rounded logits) outputs."""
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    tgt = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    with torch.no_grad():
        lp_f, ent_f = fused_logprobs_entropy(h, w, tgt)
        ref_lp, ref_ent = vanilla_logprobs_entropy(h.float(), w.float(), tgt)  # fp32 logits: the better reference
    return dict(
        max_abs_err_logprob_vs_fp32=float((lp_f - ref_lp).abs().max()),
        max_abs_err_entropy_vs_fp32=float((ent_f - ref_ent).abs().max()),
    )


def profile(name: str, fn, tokens: int, hidden: int, vocab: int, chunk_size: int) -> dict:
    """Device time per kernel name (ms) for one forward + backward of ``fn``, after a warm-up step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from prime_rl.trainer.loop import kernel_times  # the trainer loop's own definition of device time per kernel

    step, *_ = head_step(fn, tokens, hidden, vocab, chunk_size)
    step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    times = kernel_times(prof, wall_s=0.0, steps=1)["kernels"]
    kernels = sorted(((name, k["us"] / 1e3, k["calls"]) for name, k in times.items()), key=lambda k: -k[1])
    top = [dict(kernel=k[:90], ms=round(ms, 3), calls=n) for k, ms, n in kernels[:12]]
    rest = sum(ms for _, ms, _ in kernels[12:])
    total = sum(ms for _, ms, _ in kernels)
    return dict(kind="profile", head=name, tokens=tokens, device_ms=round(total, 2), rest_ms=round(rest, 3), top=top)


def run_anchor(path: str) -> dict | None:
    spec = importlib.util.spec_from_file_location("anchor_hf_train", path)
    anchor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(anchor)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        anchor.lm_head()
    line = buf.getvalue().strip().splitlines()[-1]
    res = json.loads(line)
    print(json.dumps(dict(res, kind="anchor", anchor_kind=res.get("kind"))), flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk-size", type=int, default=8192)
    p.add_argument("--anchor", default=None, help="path to anchor_hf_train.py; runs its lm_head() first")
    p.add_argument("--profile", nargs="*", default=[], help="heads to profile at the largest --tokens")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="5-step timings per head (median reported): one call's means moved 5-10%%",
    )
    args = p.parse_args()
    print(json.dumps(dict(kind="env", torch=torch.__version__, device=torch.cuda.get_device_name())), flush=True)
    anchor = run_anchor(args.anchor) if args.anchor else None
    results = {}
    paths = [("vanilla", vanilla), ("fused", fused), ("nll_sum", nll_sum), ("nll_sum_liger_chunk", nll_sum_liger_chunk),
             ("token_loss", token_loss)]  # fmt: skip
    if importlib.util.find_spec("liger_kernel") is not None:  # the peer SFT users switch on, same process
        paths.append(("liger_flce", liger_flce))
    unknown = set(args.profile) - {name for name, _ in paths}
    if unknown:
        p.error(f"--profile {sorted(unknown)}: not a head here; choose from {[name for name, _ in paths]}")
    for tokens in args.tokens:
        for name, fn in paths:
            res = bench(fn, tokens, args.hidden, args.vocab, args.chunk_size, args.repeats)
            results[(name, tokens)] = res
            kind = (
                f"{name}_lm_head_logprob_entropy"
                if name in ("vanilla", "fused")
                else f"{name.removesuffix('_loss')}_loss"
            )
            row = dict(kind=kind, tokens=tokens, hidden=args.hidden, vocab=args.vocab)
            print(json.dumps(dict(row, chunk_size=args.chunk_size, **res) if name == "fused" else dict(row, **res)))
    print(json.dumps(dict(kind="agreement", tokens=4096, **agreement(4096, args.hidden, args.vocab))), flush=True)
    try:
        from prime_rl.kernels.lm_head.triton_kernels import lm_head_dlogits_kernel, lm_head_fwd_kernel

        cfgs = dict(forward=str(lm_head_fwd_kernel.best_config), dlogits=str(lm_head_dlogits_kernel.best_config))
        print(json.dumps(dict(kind="triton_configs", **cfgs)), flush=True)
    except (ImportError, AttributeError):
        pass
    t0 = args.tokens[0]
    fused0, vanilla0 = results.get(("fused", t0), {}), results.get(("vanilla", t0), {})
    summary = dict(kind="summary", tokens=t0)
    if "ms" in fused0 and "ms" in vanilla0:
        summary.update(speedup_vs_vanilla=round(vanilla0["ms"] / fused0["ms"], 3))
    if anchor and "ms" in fused0:
        summary.update(
            speedup_vs_anchor=round(anchor["ms"] / fused0["ms"], 3),
            memory_ratio_vs_anchor=round(fused0["peak_extra_gib"] / anchor["peak_extra_gib"], 4),
        )
    for tokens in args.tokens:  # the SFT head against Liger, and the RL head against the SFT head
        ce, liger, rl, rl_tl = (results.get((n, tokens), {}) for n in ("nll_sum", "liger_flce", "fused", "token_loss"))
        if "ms" in ce and "ms" in liger:
            summary[f"nll_sum_speedup_vs_liger_{tokens}"] = round(liger["ms"] / ce["ms"], 3)
        ce_lc = results.get(("nll_sum_liger_chunk", tokens), {})
        if "ms" in ce_lc and "ms" in liger:  # the same chunk rule as Liger: speed at (about) its memory
            summary[f"nll_sum_liger_chunk_speedup_vs_liger_{tokens}"] = round(liger["ms"] / ce_lc["ms"], 3)
            summary[f"nll_sum_liger_chunk_memory_vs_liger_{tokens}"] = round(
                ce_lc["peak_extra_gib"] / liger["peak_extra_gib"], 3
            )
        if "ms" in ce and "ms" in rl:
            summary[f"rl_head_over_nll_sum_{tokens}"] = round(rl["ms"] / ce["ms"], 3)
        if "ms" in ce and "ms" in rl_tl:  # what the RL trainer runs for the token ratio (`fused_token_loss`)
            summary[f"rl_token_loss_over_nll_sum_{tokens}"] = round(rl_tl["ms"] / ce["ms"], 3)
    print(json.dumps(summary), flush=True)
    for name in args.profile:
        fn = dict(paths)[name]
        print(json.dumps(profile(name, fn, max(args.tokens), args.hidden, args.vocab, args.chunk_size)), flush=True)


if __name__ == "__main__":
    main()
