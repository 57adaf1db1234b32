"""Seed MoE models on one GPU: `sft` on fake data at the GLM-4.5-Air and Nemotron-3 Nano shapes, reduced in depth.

    python benchmarks/moe_models.py                          # both models, one H200
    python benchmarks/moe_models.py --model glm-4.5-air --layers 3
    python benchmarks/moe_models.py --model nemotron-h --layers 7
    python benchmarks/moe_models.py --tiny                   # CPU smoke test (tiny widths, no compile)

Each model keeps its published widths (GLM-4.5-Air: hidden 4096, 96/8 heads, 128 routed experts top-8 + 1
shared, 1408 wide, dense first layer 10944 wide, vocab 151552; Nemotron-3-Nano-30B-A3B: hidden 2688, Mamba-2
64 heads x 64, 8 groups, state 128, 128 experts top-6 + a shared one, 1856 wide, vocab 131072) and only
`--layers` of its depth: GLM keeps its dense first layer and `layers - 1` MoE layers; Nemotron-H takes the
first `layers` characters of Nano's hybrid pattern ("MEMEM*E...": Mamba-2, MoE, attention), which must
hold at least one of each. The defaults, GLM 1 dense + 2 MoE (6.2B parameters, 1.4B active) and Nemotron-H
"MEMEM*E" (4.7B, 0.7B active), hold fp32 masters + gradients + AdamW (16 bytes/param) and the gathered bf16
weights in one H200: the trainer's memory plan estimates 105 and 81 GiB at seq 4096 (`est_peak_mem_gib`).

For each model it writes a random-weight HF model directory (cached under --workdir, via
benchmarks/trainer.py's `write_model_dir`), runs the real `sft` entrypoint on one GPU (FSDP2 over one rank,
fp32 masters, bf16 compute, full activation checkpointing `--model.ac`, the fused LM head, regional
`--model.compile`, no CPU offload) with `--data.type fake`, reads the run's monitors/file/metrics.jsonl and
prints one JSON line: parameters (total, and active per token as `flops.num_active_params` counts them:
without the input embedding), the memory plan's estimated peak, median tokens/s, MFU and step time over the
steps after `--warmup`, peak memory, and every step's loss. A non-finite loss or a failed run gives an
"error" field (and exit status 1 once all models ran).
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from trainer import write_model_dir  # noqa: E402 - benchmarks/trainer.py, the SFT benchmark

# Published config.json values (zai-org/GLM-4.5-Air; nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16), full depth.
GLM_4_5_AIR = dict(
    architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=151552, hidden_size=4096,
    intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46, num_attention_heads=96,
    num_key_value_heads=8, head_dim=128, n_routed_experts=128, num_experts_per_tok=8, n_shared_experts=1,
    first_k_dense_replace=1, n_group=1, topk_group=1, partial_rotary_factor=0.5, attention_bias=True,
    routed_scaling_factor=1.0, norm_topk_prob=True, use_qk_norm=False, tie_word_embeddings=False,
    rms_norm_eps=1e-5, rope_theta=1000000, max_position_embeddings=131072, hidden_act="silu",
    num_nextn_predict_layers=0, initializer_range=0.02, torch_dtype="bfloat16",
)  # fmt: skip
NEMOTRON_3_NANO = dict(
    architectures=["NemotronHForCausalLM"], model_type="nemotron_h", vocab_size=131072, hidden_size=2688,
    intermediate_size=1856, hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    num_hidden_layers=52, num_attention_heads=32, num_key_value_heads=2, head_dim=128, mamba_num_heads=64,
    mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128, use_conv_bias=True,
    use_bias=False, n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
    moe_shared_expert_intermediate_size=3712, n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True,
    routed_scaling_factor=2.5, mlp_hidden_act="relu2", layer_norm_epsilon=1e-5, tie_word_embeddings=False,
    max_position_embeddings=262144, initializer_range=0.02, torch_dtype="bfloat16",
)  # fmt: skip
MODELS = {"glm-4.5-air": GLM_4_5_AIR, "nemotron-h": NEMOTRON_3_NANO}
DEFAULT_LAYERS = {"glm-4.5-air": 3, "nemotron-h": 7}
# --tiny: the same structure at CPU size (hidden 64, 4 experts, vocab 256).
TINY = {
    "glm-4.5-air": dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=1024),
    "nemotron-h": dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
                       n_groups=2, chunk_size=32, n_routed_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, moe_shared_expert_intermediate_size=64,
                       max_position_embeddings=1024),
}  # fmt: skip


def model_config(model: str, layers: int, tiny: bool) -> dict:
    """The published config at `layers` depth (and tiny widths with `tiny`)."""
    config = {**MODELS[model], **(TINY[model] if tiny else {}), "num_hidden_layers": layers}
    if model == "glm-4.5-air":
        if layers < 2:
            raise SystemExit(f"--layers {layers}: GLM-4.5-Air needs >= 2 (its dense first layer and a MoE layer)")
    else:
        pattern = config["hybrid_override_pattern"][:layers]
        if len(pattern) < layers or not {"M", "E", "*"} <= set(pattern):
            raise SystemExit(
                f"--layers {layers}: Nemotron-H's pattern prefix {pattern!r} needs a Mamba (M), a MoE (E) and an "
                f"attention (*) layer; use 6..{len(config['hybrid_override_pattern'])}"
            )
        config["hybrid_override_pattern"] = pattern
    return config


def plan(model_dir: Path, tokens: int, chunk: int) -> dict:
    """Parameter counts and the trainer's own memory estimate for this run (AC on, no offload)."""
    from prime_rl.common.config.trainer import TrainerModelConfig
    from prime_rl.trainer.memory_plan import GiB, footprint, peak_bytes
    from prime_rl.trainer.models.config import load_arch_config
    from prime_rl.trainer.models.flops import num_active_params

    fp = footprint(TrainerModelConfig(name=str(model_dir)))
    peak = peak_bytes(fp, tokens, "none", True, False, reshard_after_forward=False, lm_head_chunk=chunk)
    return dict(
        params=fp.num_params,
        active_params=num_active_params(load_arch_config(model_dir)),
        est_peak_mem_gib=round(peak / GiB, 2),
    )


def run(model: str, args: argparse.Namespace) -> dict:
    layers = args.layers or DEFAULT_LAYERS[model]
    config = model_config(model, layers, args.tiny)
    tag = f"{model}-L{layers}{'-tiny' if args.tiny else ''}"
    model_dir = write_model_dir(config, args.workdir / f"{tag}-random")
    seq_len = args.seq_len or (128 if args.tiny else 4096)
    compile_ = (not args.tiny) if args.compile is None else args.compile
    out = dict(bench="sft-moe", model=model, layers=layers, tiny=args.tiny, seq_len=seq_len, compile=compile_)
    out["pattern"] = config.get("hybrid_override_pattern") or f"1 dense + {layers - 1} moe"
    out.update(plan(model_dir, seq_len, args.chunk))
    name = f"moe-{tag}-s{seq_len}-c{int(compile_)}"
    cmd = [sys.executable, "-m", "prime_rl.trainer.sft.entrypoint", "--model.name", str(model_dir),
           "--data.type", "fake", "--data.seq-len", str(seq_len), "--data.batch-size", "1",
           "--data.micro-batch-size", "1", "--max-steps", str(args.steps), "--optim.type", "adamw",
           "--model.offload", "none", "--model.ac", "--model.ac-offloading", "None",
           "--model.fused-lm-head-token-chunk-size", str(args.chunk), "--deployment.num-gpus", "1",
           "--output-dir", str(args.workdir), "--run-name", name, "--no-ckpt.export-hf",
           "--no-model.reshard-after-forward"]  # fmt: skip
    cmd += ["--model.compile"] if compile_ else []
    cmd += args.extra
    metrics_path = args.workdir / name / "monitors/file/metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0 or not metrics_path.is_file():
        return {**out, "error": f"sft exited {proc.returncode}"}
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    losses = [r.get("loss/mean") for r in rows]
    measured = rows[args.warmup :] or rows[-1:]

    def med(key: str) -> float | None:
        values = [r[key] for r in measured if key in r]
        return statistics.median(values) if values else None

    mfu = med("perf/mfu")
    out.update(
        steps=len(rows), steps_measured=len(measured),
        tokens_per_s=round(med("perf/throughput")), mfu=None if mfu is None else round(mfu, 4),
        step_s=round(med("time/step"), 4),
        peak_mem_gib=round(max(r.get("perf/peak_memory", 0.0) for r in rows), 2),
        losses=[None if loss is None else round(loss, 4) for loss in losses],
    )  # fmt: skip
    if len(rows) != args.steps:
        out["error"] = f"metrics.jsonl has {len(rows)} steps, expected {args.steps}"
    elif not all(loss is not None and math.isfinite(loss) for loss in losses):
        out["error"] = "non-finite loss"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["both", *MODELS], default="both")
    p.add_argument("--layers", type=int, default=None, help=f"depth (default {DEFAULT_LAYERS})")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 4096; --tiny: 128)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the medians (compile, allocator)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="default: on (--tiny off)")
    p.add_argument("--chunk", type=int, default=8192, help="fused LM head token chunk")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: hidden 64, 4 experts, vocab 256, seq 128")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/prime-rl-bench"))
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more sft flags (last)")
    args = p.parse_args()

    failed = False
    for model in MODELS if args.model == "both" else [args.model]:
        result = run(model, args)
        failed |= "error" in result
        print(json.dumps(result), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
