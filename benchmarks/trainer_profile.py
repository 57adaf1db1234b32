"""Where an SFT step's GPU time goes; prints JSON lines.

    python benchmarks/trainer_profile.py attn                     # core attention kernels, fwd + bwd
    python benchmarks/trainer_profile.py step -- <sft flags>      # profile the real sft step, one process
    python benchmarks/trainer_profile.py compare DIR [DIR ...]    # the real loops' kernels.json side by side

`attn`: forward + backward of causal attention over one 8192-token row (Qwen3-1.7B heads: 16 q / 8 kv,
head_dim 128) with each kernel: SDPA restricted to cuDNN, to flash, the trainer's `auto` dense path, and
`varlen_attn`; reports ms, TFLOP/s (causal FLOPs) and the largest difference from the flash output.

`step`: builds the model and optimizer exactly as `sft` does (same config flags, e.g. from
benchmarks/trainer.py), runs the step loop (train_step, clip, optimizer), profiles two steps after warmup
and sums GPU kernel time per category (GEMM, attention, LM head, optimizer, copies/casts, compiled
elementwise, ...), plus the top kernels.

`compare`: each DIR is a `PRIME_RL_PROFILE_DIR` the trainer's real loop wrote (`sft` or the RL trainer, any
entrypoint, e.g. `PRIME_RL_PROFILE_DIR=/tmp/p_rl python benchmarks/rl_trainer.py`): per step, the wall time, the
device time per category, and the kernels whose time differs most from the first DIR's. The loops' own order and
host work are in it (RL's objective, the publisher's copies), which `step` leaves out.
"""

import json
import statistics
import sys
import time
from collections import defaultdict

import torch


def _time(fn, iters: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_attention(seq: int = 8192, hq: int = 16, hkv: int = 8, dim: int = 128) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from prime_rl.trainer.models import PackedSeqs
    from prime_rl.trainer.models.attention import VarlenAttention, dense_causal_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(seq, h, dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        for h in (hq, hkv, hkv)
    )
    grad = torch.randn_like(q)
    seqs = PackedSeqs.from_position_ids(torch.arange(seq, device="cuda")[None])
    flops = 4 * seq * seq * hq * dim / 2 * (1 + 2.5)  # causal fwd (2 matmuls) + bwd (5 matmuls)

    def sdpa_only(backend):
        def run():
            with sdpa_kernel([backend]):
                qb, kb, vb = (x.transpose(0, 1)[None] for x in (q, k, v))
                return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)[0].transpose(0, 1)

        return run

    variants = {
        "sdpa_cudnn": sdpa_only(SDPBackend.CUDNN_ATTENTION),
        "sdpa_flash": sdpa_only(SDPBackend.FLASH_ATTENTION),
        "auto_dense (cudnn>flash)": lambda: dense_causal_attention(q, k, v, 1),
        "varlen_attn": lambda: VarlenAttention()(q, k, v, seqs),
    }
    ref = None
    for name, fwd in variants.items():
        try:
            out = fwd()
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
            if ref is None:
                ref = (out.detach().float(), dq.float(), dk.float(), dv.float())
            err = max((a.float() - b).abs().max().item() for a, b in zip((out, dq, dk, dv), ref))

            def step(fwd=fwd):
                torch.autograd.grad(fwd(), (q, k, v), grad)

            s = _time(step)
            fs = _time(lambda fwd=fwd: fwd().detach())
            row = dict(kind="attention", name=name, fwd_bwd_ms=round(s * 1e3, 3), fwd_ms=round(fs * 1e3, 3),
                       tflops=round(flops / s / 1e12, 1), max_abs_diff_vs_first=round(err, 5))  # fmt: skip
        except Exception as e:  # a backend that refuses the shape is a result too
            row = dict(kind="attention", name=name, error=repr(e)[:300])
        print(json.dumps(row), flush=True)


CATEGORIES = [  # first match wins; kernel names as seen in CUDA traces
    ("attention", ("flash", "fmha", "cudnn", "attn", "sdpa")),
    ("lm_head_triton", ("lm_head", "ce_rows")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "norm_kernel", "lpnorm")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90", "sm80", "cublas")),
    ("nccl", ("nccl",)),
    ("copy_cast", ("copy", "memcpy", "memset", "cat", "split", "fill", "to_copy")),
    ("compiled_triton", ("triton_",)),
]


def _category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(key in low for key in keys):
            return cat
    return "other"


def per_step_ms(times: dict) -> tuple[dict[str, float], dict[str, float]]:
    """A `kernel_times` record (the loop profiler's `kernels.json`) -> device ms per step by kernel and by category."""
    per_kernel = {name: k["us"] / 1e3 / times["steps"] for name, k in times["kernels"].items()}
    per_cat: dict[str, float] = defaultdict(float)
    for name, ms in per_kernel.items():
        per_cat[_category(name)] += ms
    return per_kernel, dict(per_cat)


def profile_step(argv: list[str], warmup: int = 4, profiled: int = 2) -> None:
    from torch.profiler import ProfilerActivity, profile

    from prime_rl.common.config import parse_config
    from prime_rl.common.config.trainer import SFTConfig
    from prime_rl.trainer.loop import kernel_times
    from prime_rl.trainer.memory_plan import resolve_memory
    from prime_rl.trainer.model import build_training_model
    from prime_rl.trainer.optim import build_optimizer, clip_grad_norm
    from prime_rl.trainer.sft.train import forward_backward, setup
    from prime_rl.trainer.world import close_world, init_world

    cfg = parse_config(SFTConfig, argv, prog="trainer_profile")
    world = init_world()
    dims, loader, _ = setup(cfg, world)
    mesh = dims.build_mesh(world.device.type)
    # "auto" offload / ac resolved the way `sft` resolves them (the builders refuse an unresolved "auto")
    model_cfg = resolve_memory(cfg.model, cfg.data.micro_batch_size * cfg.data.seq_len, world.device,
                               shard=dims.dp_shard, cp=dims.cp)  # fmt: skip
    model = build_training_model(model_cfg, dims, mesh, world.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(cfg.optim, params)

    def step(i: int) -> None:  # the sft loop's order: host syncs only after the optimizer step is queued
        stats = forward_backward(model, loader.micro_batches(i), dims, world)
        norm = clip_grad_norm(params, cfg.optim.max_norm, optimizer)  # fused AdamW on CUDA: the clip in its step
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        norm.item(), stats["loss"].item()

    cuda = world.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None  # CPU: a smoke test of this script
    times = []
    for i in range(warmup):
        sync()
        t = time.perf_counter()
        step(i)
        sync()
        times.append(time.perf_counter() - t)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for i in range(warmup, warmup + profiled):
            step(i)
        sync()
    per_kernel, per_cat = per_step_ms(kernel_times(prof, wall_s=0.0, steps=profiled))
    total = sum(per_cat.values())
    print(json.dumps(dict(kind="step_times_s", warmup_steps=[round(t, 4) for t in times])), flush=True)
    print(json.dumps(dict(kind="gpu_time_per_step_ms", total=round(total, 2),
                          **{k: round(v, 2) for k, v in sorted(per_cat.items(), key=lambda kv: -kv[1])})),
          flush=True)  # fmt: skip
    for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:25]:
        print(json.dumps(dict(kind="kernel", ms=round(ms, 3), cat=_category(name), name=name[:140])), flush=True)
    close_world()


def compare(dirs: list[str], top: int = 15) -> None:
    """One JSON line per DIR (wall and device ms per step, by category), then the kernels that differ most."""
    from pathlib import Path

    runs = []
    for d in dirs:
        data = json.loads((Path(d) / "kernels.json").read_text())
        steps = data["steps"]
        per_kernel, per_cat = per_step_ms(data)
        runs.append(per_kernel)
        print(json.dumps(dict(kind="profile_dir", dir=d, steps=steps, wall_ms=round(data["wall_s"] * 1e3 / steps, 2),
                              device_ms=round(sum(per_kernel.values()), 2),
                              **{k: round(v, 2) for k, v in sorted(per_cat.items(), key=lambda kv: -kv[1])})),
              flush=True)  # fmt: skip
    base = runs[0]
    for d, run in zip(dirs[1:], runs[1:], strict=True):
        names = set(base) | set(run)
        diffs = sorted(names, key=lambda n: -abs(run.get(n, 0.0) - base.get(n, 0.0)))[:top]
        for name in diffs:
            print(json.dumps(dict(kind="kernel_diff", dir=d, ms=round(run.get(name, 0.0), 3),
                                  base_ms=round(base.get(name, 0.0), 3), cat=_category(name), name=name[:140])),
                  flush=True)  # fmt: skip


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "compare":
        compare(sys.argv[2:])
        return
    if len(sys.argv) < 2 or sys.argv[1] not in ("attn", "step"):
        print(__doc__)
        sys.exit(2)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(json.dumps(dict(kind="env", torch=torch.__version__, device=device)), flush=True)
    if sys.argv[1] == "attn":
        bench_attention()
    else:
        argv = sys.argv[2:]
        profile_step(argv[1:] if argv[:1] == ["--"] else argv)


if __name__ == "__main__":
    main()
