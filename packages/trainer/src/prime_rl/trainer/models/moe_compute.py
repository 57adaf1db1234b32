"""Routed-expert GEMM precision (`[model.moe.compute]`): bf16, or blockwise-scaled FP8 as DeepSeek-V3 trains.

    x (M, H) sorted by expert, counts (E,), w_gate / w_up (E, I, H), w_down (E, H, I) -> (M, H)
    y[rows of e] = (silu(x_e @ w_gate[e].T) * (x_e @ w_up[e].T)) @ w_down[e].T, each GEMM in the chosen precision

Design:
- `type = "bf16"` (default): the grouped GEMM of `prime_rl.kernels.grouped_gemm` (Triton on CUDA).
- `type = "fp8"`: every expert GEMM, forward and backward, takes e4m3 operands with fp32 scales, one scale
  per 1x128 block of an activation or gradient row (along the contraction) and one per 128x128 block of a
  weight, accumulates in fp32 and writes the activation dtype. The weight gradient contracts over tokens,
  so its operands (the output gradient and the input, both transposed) are quantized in 128-token blocks
  within each expert (DeepSeek-V3's 128x1 backward tiles). The SwiGLU between the GEMMs stays in the
  activation dtype. Master weights, gradients and the optimizer are untouched: a weight is quantized
  where it is used (the local shard under EP, the gathered one under FSDP) and again in backward, which
  keeps nothing in memory the bf16 path does not keep (x and w are saved, not their fp8 copies).
- The recipe's quantizer (amax / 448 per block, floored, NaN kept, partial blocks zero-padded) is
  `prime_rl.kernels.grouped_gemm.fp8_reference`, re-exported here; both GEMM paths reproduce it.
- Where it runs: on CUDA SM90 with triton, the Triton grouped kernels of
  `prime_rl.kernels.grouped_gemm.fp8_op` (one launch per GEMM for all experts, quantization in Triton, no
  host sync, so the MoE block compiles as one graph as with bf16). Its speed is not measured yet: start-up
  says so (FP8_TRITON_WARNING). Otherwise `fp8_grouped_swiglu_torch`, the reference and fallback: on SM90
  each expert's GEMM is one `torch.nn.functional.scaled_mm` (cuBLASLt's DeepSeek-style 1x128 x 128x128 and
  1x128 x 1x128 scaling, which torch implements only for SM90). torch's grouped scaled GEMM
  (`scaled_grouped_mm`) takes only tensorwise or rowwise scales on SM90, so this is a per-expert loop with
  one host sync for the token counts, 9-16x slower than bf16 (FP8_SLOW_WARNING). The loop runs on each
  expert's rows padded with zero rows to whole 128-row blocks (`ExpertRows`: cuBLASLt has no algorithm
  for a row count that is not a multiple of 4), dropped from the outputs. On any other device a reference
  path dequantizes the same e4m3 payloads and scales and multiplies in fp32: what the GPU computes, up to
  accumulation order. It is what the CPU tests check against bf16; it is not fast.
- `type = "deepgemm_fp8"` (DeepGEMM's grouped kernels) and `type = "mxfp8"` (SM100) refuse at start-up,
  naming what is missing, as Mega MoE dispatch does: no untested kernel path is shipped for them.
- Left out: FP8 for Nemotron-H's relu^2 experts (refused at start-up), and FP8 weight caching across micro-batches (weights change every optimizer step only, but caching would
  hold one more copy of every expert weight).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from prime_rl.common.config.trainer import (
    DeepGEMMFP8ComputeConfig,
    FP8ComputeConfig,
    MoEComputeConfig,
    MXFP8ComputeConfig,
)
from prime_rl.kernels.grouped_gemm import grouped_swiglu
from prime_rl.kernels.grouped_gemm.fp8_reference import (  # noqa: F401  (re-exported: the recipe's names)
    AMAX_FLOOR,
    BLOCK,
    FP8,
    FP8_MAX,
    dequantize_1x128,
    dequantize_128x128,
    quantize_1x128,
    quantize_128x128,
)

try:  # resolved at import, as the bf16 path does: the Triton kernels exist only where triton imports
    from prime_rl.kernels.grouped_gemm.fp8_op import fp8_grouped_swiglu_triton
except ImportError:
    fp8_grouped_swiglu_triton = None

FP8_SLOW_WARNING = (
    '[model.moe.compute] type = "fp8" runs its fallback here, a correctness path, not a fast one: its '
    'per-expert loop of scaled_mm calls measured 9.0-16.4x the time of type = "bf16" (routed-expert forward + '
    "backward, H200, 128 experts x 2048 x 768, three runs; 5.6-11.2x at 16 experts) with a max error of 0.07 "
    'vs 0.005 against fp32 (benchmarks/results/grouped_gemm.md); use type = "bf16" for speed'
)
"""Logged at start-up when fp8 runs the torch fallback (no triton, or off the GPU): what it costs, measured
on 2026-12-02, so that nobody picks it for speed."""
FP8_TRITON_WARNING = (
    '[model.moe.compute] type = "fp8" runs the Triton grouped blockwise-FP8 GEMM, whose speed has not been '
    "measured on a GPU yet (benchmarks/moe_compute.py); its error is ~12x bf16's (e4m3 operands, measured on CPU); "
    'type = "bf16" is the measured default'
)
"""Logged at start-up when fp8 runs the Triton kernels: no speed is claimed before a GPU has measured it."""


# --------------------------------------------------------------------------- expert row layout


class ExpertRows:
    """The per-expert row counts of x (sorted by expert) and the layout every FP8 GEMM runs on: each expert's
    rows followed by zero rows up to a whole 128-row block.

    Why padded: cuBLASLt's blockwise FP8 GEMM on SM90 has no algorithm (CUBLAS_STATUS_NOT_SUPPORTED from
    cublasLtMatmulAlgoGetHeuristic) for a row count that is not a multiple of 4 (H200, torch 2.11: 1023,
    1022, 129 and 2 rows failed, 1024, 1020, 132 and 4 ran), and routing gives experts any count. Why 128
    and not 4: every expert then starts on a 128-row boundary, so the weight gradient's 128-token blocks,
    which must not cross experts, come out of one quantization of all rows instead of one per expert
    (those per-expert passes were, by count, most of the fp8 path's kernel launches), and it is the layout
    DeepGEMM's contiguous grouped GEMM takes. A zero row adds nothing to any product and its output row is
    dropped. Cost: at most 127 zero rows per expert (on average 6% more rows at 1,024 tokens per expert),
    and the weight gradient's fp32 transposed copies of dy and x are made for all experts at once.
    """

    def __init__(self, splits: list[int], device: torch.device) -> None:
        self.splits = splits
        self.padded = [m + -m % BLOCK for m in splits]
        self.num_rows, self.num_padded = sum(splits), sum(self.padded)
        self.index = None  # row i of x -> row index[i] of the padded layout; None: nothing to pad
        if self.num_padded != self.num_rows:
            shifts, shift = [], 0
            for m, mp in zip(splits, self.padded, strict=True):
                shifts.append(shift)
                shift += mp - m
            per_expert = torch.tensor(shifts, device=device)
            counts = torch.tensor(splits, device=device)
            shift_per_row = torch.repeat_interleave(per_expert, counts, output_size=self.num_rows)  # no host sync
            self.index = torch.arange(self.num_rows, device=device) + shift_per_row

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(M, K) -> (Mp, K), zero rows after each expert's rows."""
        if self.index is None:
            return x
        return x.new_zeros(self.num_padded, x.shape[1]).index_copy_(0, self.index, x)

    def blocks(self):  # noqa: ANN201
        """(expert, padded row slice) for each expert with tokens."""
        start = 0
        for e, mp in enumerate(self.padded):
            if mp:
                yield e, slice(start, start + mp)
            start += mp


# --------------------------------------------------------------------------- GEMMs


def sm90_scaled_mm_enabled(device: torch.device) -> bool:
    """Whether FP8 expert GEMMs on this device run torch's blockwise scaled_mm (CUDA SM90 only)."""
    return (
        device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] == 9
        and hasattr(F, "scaled_mm")  # torch >= 2.10
    )


def _outer_major(scale: torch.Tensor) -> torch.Tensor:
    """A 1x128 scale (rows, K/128) with strides exactly (1, rows), as torch checks them (a copy unless the
    storage is already so laid out). Exact also on size-1 dims: for one K block (an expert's weight gradient
    over at most 128 tokens) a plain `.t().contiguous().t()` leaves strides (1, 1), and torch refused that
    (H200: `scale_a strides must be (1, 256); got: [1, 1]`)."""
    return scale.t().contiguous().as_strided(scale.shape, (1, scale.shape[0]))


def _weight_scales_for_gemm(w_s: torch.Tensor) -> torch.Tensor:
    """128x128 scales (E, N/128, K/128), any strides -> (E, N/128, Kb4) contiguous, the K blocks padded to a
    multiple of 4 (cuBLASLt's 16-byte alignment), so that `[e].t()` is the (Kb4, N/128) tensor with strides
    (1, Kb4) torch checks for. Always contiguous: the input gradient passes w's scales transposed, and when
    their K-block count was already a multiple of 4 nothing was padded, the view kept its strides and torch
    refused it (`scale_b must have strides (1, 16); got [6, 1]`, H200)."""
    padded = F.pad(w_s, (0, -w_s.shape[-1] % 4), value=1.0).contiguous()
    _, nb, kb4 = padded.shape  # plain strides also on size-1 dims, where contiguous() may keep odd ones
    return padded.as_strided(padded.shape, (nb * kb4, kb4, 1))


def _scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_blocks: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """a (m, K) e4m3 row-major, m a multiple of 4, with 1x128 scales (m, K/128) of strides (1, m); b (n, K)
    e4m3 row-major with 1x128 (`b_blocks=1`: scales (n, K/128), strides (1, n)) or 128x128 (`b_blocks=128`:
    scales from `_weight_scales_for_gemm`, one expert's (n/128, Kb4)) scales -> a @ b.T (m, n) via cuBLASLt."""
    # layouts torch's SM90 blockwise path checks (aten/src/ATen/native/cuda/ScaledBlas.cpp): a row-major,
    # b column-major; 1x128 scales outer-dim-major; 128x128 scales K-major, passed as (Kb4, n/128)
    recipe = F.ScalingType
    if b_blocks == 1:
        sb, recipe_b = _outer_major(b_scale), recipe.BlockWise1x128
    else:
        sb, recipe_b = b_scale.t(), recipe.BlockWise128x128
    return F.scaled_mm(a, b.t(), _outer_major(a_scale), recipe.BlockWise1x128, sb, recipe_b, output_dtype=out_dtype)


def _grouped_fprop(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    rows: ExpertRows,
    n: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """a (Mp, Kp) in `rows`' padded layout; per expert e: a[rows of e] @ w[e].T -> (M, n), padding rows
    dropped: the forward and the input gradient. w_q (E, Np, Kp) and w_s (E, Np/128, Kp/128), any strides."""
    use_gpu = sm90_scaled_mm_enabled(a_q.device) and out_dtype in (torch.bfloat16, torch.float32)
    if use_gpu:  # once for all experts, not once per expert: b row-major, its scales as torch wants them
        w_q, w_s = w_q.contiguous(), _weight_scales_for_gemm(w_s)
    else:  # reference: the same payloads and scales, dequantized, multiplied in fp32
        a, w = dequantize_1x128(a_q, a_s), dequantize_128x128(w_q, w_s)
    outputs = []
    for e, block in rows.blocks():
        if use_gpu:
            y = _scaled_mm(a_q[block], a_s[block], w_q[e], w_s[e], BLOCK, out_dtype)
        else:
            y = (a[block] @ w[e].t()).to(out_dtype)
        outputs.append(y[: rows.splits[e], :n])
    return torch.cat(outputs) if outputs else a_q.new_zeros(0, n, dtype=out_dtype)


def _grouped_wgrad(
    dy: torch.Tensor, x: torch.Tensor, rows: ExpertRows, num_experts: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """dy (Mp, N), x (Mp, K) in `rows`' padded layout -> (E, N, K): per expert dy[rows].T @ x[rows], both
    operands quantized in 128-token blocks within the expert; zero for an expert without tokens."""
    n, k = dy.shape[1], x.shape[1]
    # every expert starts on a 128-row boundary: one quantization along tokens gives each expert's blocks
    dyt_q, dyt_s = quantize_1x128(dy.t())  # (N, Mp), (N, Mp / 128)
    xt_q, xt_s = quantize_1x128(x.t())  # (K, Mp), (K, Mp / 128)
    use_gpu = sm90_scaled_mm_enabled(dy.device) and out_dtype in (torch.bfloat16, torch.float32)
    if use_gpu:
        # token-block-major scales: one expert's blocks [pb, pb + mb) of these, transposed, are the (N, mb)
        # scales with strides (1, N) torch wants, with no copy per expert
        dyt_s, xt_s = dyt_s.t().contiguous(), xt_s.t().contiguous()
    else:
        dyt, xt = dequantize_1x128(dyt_q, dyt_s), dequantize_1x128(xt_q, xt_s)
    grads = []
    for e, block in rows.blocks():
        if use_gpu:
            sblock = slice(block.start // BLOCK, block.stop // BLOCK)
            # a column slice of the payload is strided: copied so a and b are plain row-major operands
            a, b = dyt_q[:, block].contiguous(), xt_q[:, block].contiguous()
            grads.append((e, _scaled_mm(a, dyt_s[sblock].t(), b, xt_s[sblock].t(), 1, out_dtype)))
        else:
            grads.append((e, (dyt[:, block] @ xt[:, block].t()).to(out_dtype)))
    per_expert = dict(grads)
    zero = dy.new_zeros(n, k, dtype=out_dtype) if len(per_expert) < num_experts else None
    return torch.stack([per_expert.get(e, zero) for e in range(num_experts)])


class FP8GroupedLinear(torch.autograd.Function):
    """x (M, K) sorted by expert, w (E, N, K), rows (`ExpertRows`) -> (M, N), x_e @ w[e].T per expert,
    blockwise FP8 in forward and in both backward GEMMs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, rows: ExpertRows) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x, w)  # unpadded and unquantized: nothing kept that bf16 does not keep
        ctx.rows = rows
        x_q, x_s = quantize_1x128(rows.pad(x))
        w_q, w_s = quantize_128x128(w)
        return _grouped_fprop(x_q, x_s, w_q, w_s, rows, w.shape[1], x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:  # noqa: ANN001
        x, w = ctx.saved_tensors
        rows = ctx.rows
        dx = dw = None
        dy_p = rows.pad(dy)
        if ctx.needs_input_grad[0]:
            dy_q, dy_s = quantize_1x128(dy_p)  # 1x128 blocks along N, the contraction of dx = dy @ w
            # w.T's 128x128 blocks are w's blocks transposed, so its payload and scales are too
            w_q, w_s = quantize_128x128(w)
            dx = _grouped_fprop(dy_q, dy_s, w_q.transpose(1, 2), w_s.transpose(1, 2), rows, x.shape[1], x.dtype)
        if ctx.needs_input_grad[1]:
            dw = _grouped_wgrad(dy_p, rows.pad(x), rows, w.shape[0], w.dtype)
        return dx, dw, None


@torch.compiler.assume_constant_result
def _cuda_major() -> int:
    """This process's GPU generation (0 without CUDA). Read while Dynamo traces the MoE block, which it could
    not put in a graph (a non-tensor torch.cuda call); one value per process, so traced as a constant."""
    return torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 0


def fp8_triton_enabled(device_type: str) -> bool:
    """Whether fp8 experts on this device type run the Triton grouped kernels: CUDA SM90 with triton (the
    recipe's wgmma fp8 path is what the kernels are written and tested for)."""
    return device_type == "cuda" and fp8_grouped_swiglu_triton is not None and _cuda_major() == 9


def fp8_grouped_swiglu(
    x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """The SwiGLU experts with every GEMM in blockwise FP8; same contract as `grouped_swiglu`. The Triton
    grouped kernels on SM90 (one launch per GEMM, no host sync), else the torch path below."""
    if fp8_triton_enabled(x.device.type):
        return fp8_grouped_swiglu_triton(x, counts, w_gate, w_up, w_down)
    return fp8_grouped_swiglu_torch(x, counts, w_gate, w_up, w_down)


def fp8_grouped_swiglu_torch(
    x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """The reference and fallback: a per-expert loop of torch's blockwise scaled_mm on SM90, dequantized
    fp32 math elsewhere."""
    rows = ExpertRows(counts.tolist(), x.device)  # one host sync, shared by the three projections and backward
    gate = FP8GroupedLinear.apply(x, w_gate, rows)  # (M, I)
    up = FP8GroupedLinear.apply(x, w_up, rows)
    return FP8GroupedLinear.apply(F.silu(gate) * up, w_down, rows)  # (M, H)


def grouped_swiglu_for(compute: str) -> Callable[..., torch.Tensor]:
    """The SwiGLU expert function for `[model.moe.compute] type`; start-up checks refused the others."""
    if compute == "fp8":
        return fp8_grouped_swiglu
    if compute == "bf16":
        return grouped_swiglu
    raise ValueError(f'[model.moe.compute] type = "{compute}" has no expert GEMM here; use "bf16" or "fp8"')


# --------------------------------------------------------------------------- start-up


def check_moe_compute(compute: MoEComputeConfig, model_type: str, device_type: str | None = None) -> None:
    """Fail at start-up, before any weight is read, with one line naming what this choice is missing.
    `device_type` None: this process's device (CUDA if visible)."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    capability = torch.cuda.get_device_capability() if device_type == "cuda" else None
    where = f"SM{capability[0]}{capability[1]}" if capability else f"no CUDA GPU ({device_type})"
    if isinstance(compute, DeepGEMMFP8ComputeConfig):
        missing = _missing("deep_gemm", ("m_grouped_fp8_gemm_nt_contiguous",))
        raise ImportError(
            f'[model.moe.compute] type = "deepgemm_fp8" needs the `deep_gemm` package (DeepGEMM: {missing} is not '
            'importable); install DeepGEMM, or use type = "fp8" (torch blockwise FP8, SM90) or "bf16"'
            if missing
            else '[model.moe.compute] type = "deepgemm_fp8" is not wired into this trainer yet; use type = "fp8" '
            '(the same blockwise recipe through torch, SM90) or "bf16"'
        )
    if isinstance(compute, MXFP8ComputeConfig):
        raise RuntimeError(
            f'[model.moe.compute] type = "mxfp8" needs an SM100 (Blackwell) GPU, found {where}; use type = "fp8" '
            '(SM90) or "bf16"'
            if not capability or capability[0] != 10
            else '[model.moe.compute] type = "mxfp8" is not wired into this trainer yet; use type = "bf16"'
        )
    if isinstance(compute, FP8ComputeConfig):
        if model_type == "nemotron_h":
            raise ValueError(
                '[model.moe.compute] type = "fp8" is implemented for SwiGLU experts, not nemotron_h\'s relu^2 '
                'experts; use type = "bf16"'
            )
        has_kernel = fp8_grouped_swiglu_triton is not None or hasattr(F, "scaled_mm")
        if device_type == "cuda" and (capability[0] != 9 or not has_kernel):
            raise RuntimeError(
                f'[model.moe.compute] type = "fp8" needs an SM90 GPU (H100/H200) with triton (or torch >= 2.10 '
                f"for torch's blockwise scaled_mm), found {where} with torch {torch.__version__} and "
                f'{"triton" if fp8_grouped_swiglu_triton is not None else "no triton"}; use type = "bf16"'
            )
        # the "trainer" logger: formatted where `rl` set it up already, stderr (logging's fallback) in `sft`
        triton_path = device_type == "cuda" and fp8_grouped_swiglu_triton is not None
        logging.getLogger("trainer").warning(FP8_TRITON_WARNING if triton_path else FP8_SLOW_WARNING)


def _missing(module: str, attrs: tuple[str, ...]) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception:  # a broken CUDA extension raises more than ImportError
        return module
    absent = [f"{module}.{a}" for a in attrs if not hasattr(mod, a)]
    return ", ".join(absent) or None


def apply_moe_compute(blocks: nn.ModuleList, compute: str) -> None:
    """Set every MoE layer's routed-expert precision (`Experts.compute`). Before expert parallelism, which
    carries it over to the expert-parallel experts."""
    for block in blocks:
        experts = getattr(getattr(block, "mlp", None), "experts", None)
        if experts is not None and hasattr(experts, "compute"):
            experts.compute = compute
