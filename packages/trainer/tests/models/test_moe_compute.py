"""Routed-expert precision (`[model.moe.compute]`, models/moe_compute.py): the blockwise FP8 quantizer's
properties, the FP8 grouped GEMMs against explicit dequantized math, a tiny Qwen3-MoE's loss and gradients
with fp8 experts against unquantized ones, the start-up refusals, and (GPU) torch's SM90 scaled_mm path
against the reference path."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from prime_rl.common.config.trainer import (
    BF16ComputeConfig,
    DeepGEMMFP8ComputeConfig,
    FP8ComputeConfig,
    MoEConfig,
    MXFP8ComputeConfig,
    TrainerModelConfig,
)
from prime_rl.kernels.grouped_gemm import grouped_swiglu_loop
from prime_rl.trainer.models import build_model, load_hf_weights, load_model_config
from prime_rl.trainer.models.moe_compute import (
    AMAX_FLOOR,
    BLOCK,
    FP8_MAX,
    FP8_TRITON_WARNING,
    ExpertRows,
    FP8GroupedLinear,
    apply_moe_compute,
    check_moe_compute,
    dequantize_1x128,
    dequantize_128x128,
    fp8_grouped_swiglu,
    fp8_grouped_swiglu_torch,
    quantize_1x128,
    quantize_128x128,
    sm90_scaled_mm_enabled,
)
from prime_rl.trainer.parallel.layout import resolve_parallel_dims

# fp8 (e4m3: 3 mantissa bits) vs unquantized experts on the tiny Qwen3-MoE below; observed on CPU:
# loss 6e-6 / 1.2e-4 relative, all gradients 0.9% / 4.2% relative in norm (cosine 0.99996 / 0.9992),
# each expert weight's gradient 6-13% relative in norm (a weight gradient sums few tokens per expert)
LOSS_REL_TOL = 1e-3
ALL_GRADS_COS_MIN = 0.995
EXPERT_GRAD_COS_MIN = 0.98


# --------------------------------------------------------------------------- quantizer


def test_1x128_scales_are_block_amax_over_448_and_round_trip_within_half_an_e4m3_step():
    torch.manual_seed(0)
    x = torch.randn(6, 3 * BLOCK) * torch.tensor([1e-3, 1.0, 300.0]).repeat_interleave(BLOCK)  # 3 scales apart
    q, scale = quantize_1x128(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (6, 3)
    amax = x.view(6, 3, BLOCK).abs().amax(-1)
    torch.testing.assert_close(scale, amax / FP8_MAX, rtol=0, atol=0)
    # each block's largest element lands on e4m3's largest value: the whole range is used
    assert (q.float().view(6, 3, BLOCK).abs().amax(-1) == FP8_MAX).all()
    # e4m3's step at the top binade [256, 448] is 32: error <= 16 quantized units = amax / 28 per block
    err = (dequantize_1x128(q, scale) - x).abs().view(6, 3, BLOCK).amax(-1)
    assert (err <= amax * 16 / FP8_MAX * (1 + 1e-6)).all()


def test_zero_blocks_quantize_to_zeros_with_a_finite_scale_and_nan_stays_nan():
    x = torch.zeros(3, 2 * BLOCK)
    x[1, BLOCK:] = torch.linspace(-2, 2, BLOCK)  # row 1: one zero block, one nonzero block
    x[2, 5] = float("nan")
    q, scale = quantize_1x128(x)
    assert (q[0].float() == 0).all() and (q[1, :BLOCK].float() == 0).all()
    floor = torch.tensor(AMAX_FLOOR) / FP8_MAX  # in fp32, as the quantizer computes it
    assert (scale[0] == floor).all() and scale[1, 0] == floor
    assert scale[1, 1] == pytest.approx(2 / FP8_MAX)  # blocks of one row have independent scales
    assert torch.isfinite(dequantize_1x128(q[:2], scale[:2])).all()
    assert torch.isnan(scale[2, 0]) and torch.isfinite(scale[2, 1])  # a NaN poisons only its own block


def test_ragged_dims_are_zero_padded_to_whole_blocks():
    x = torch.randn(4, 200)
    q, scale = quantize_1x128(x)
    assert q.shape == (4, 256) and scale.shape == (4, 2) and (q[:, 200:].float() == 0).all()
    torch.testing.assert_close(dequantize_1x128(q, scale)[:, :200], x, rtol=0.07, atol=0.07 * x.abs().max().item())
    w = torch.randn(3, 100, 300)
    wq, ws = quantize_128x128(w)
    assert wq.shape == (3, 128, 384) and ws.shape == (3, 1, 3)
    assert (wq[:, 100:].float() == 0).all() and (wq[:, :, 300:].float() == 0).all()


def test_128x128_scales_per_block_and_transpose_commutes_with_quantization():
    torch.manual_seed(0)
    w = torch.randn(2, 2 * BLOCK, 3 * BLOCK)
    w[1, :BLOCK, BLOCK : 2 * BLOCK] *= 1000  # one loud block must not coarsen its neighbours
    q, scale = quantize_128x128(w)
    amax = w.view(2, 2, BLOCK, 3, BLOCK).abs().amax(dim=(2, 4))
    torch.testing.assert_close(scale, amax / FP8_MAX, rtol=0, atol=0)
    assert scale[1, 0, 0] < scale[1, 0, 1] / 100
    err = (dequantize_128x128(q, scale) - w).abs().view(2, 2, BLOCK, 3, BLOCK).amax(dim=(2, 4))
    assert (err <= amax * 16 / FP8_MAX * (1 + 1e-6)).all()
    # the input gradient multiplies by w.T and reuses w's payload and scales transposed: exactly equal
    qt, scale_t = quantize_128x128(w.transpose(1, 2))
    assert torch.equal(qt.view(torch.uint8), q.transpose(1, 2).view(torch.uint8))
    assert torch.equal(scale_t, scale.transpose(1, 2))


# --------------------------------------------------------------------------- grouped GEMMs


def _expert_inputs(counts: list[int], k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=g).requires_grad_()
    w = (torch.randn(len(counts), n, k, generator=g) * 0.1).requires_grad_()
    return x, w


def test_fp8_grouped_linear_is_the_dequantized_math_forward_and_backward():
    # an empty expert, one spanning two 128-token weight-gradient blocks, one filling exactly one
    counts = [3, 0, 130, 128, 5]
    x, w = _expert_inputs(counts, k=96, n=160)
    y = FP8GroupedLinear.apply(x, w, ExpertRows(counts, x.device))
    dy = torch.randn_like(y)
    y.backward(dy)

    xd = dequantize_1x128(*quantize_1x128(x.detach()))[:, :96]
    wd = dequantize_128x128(*quantize_128x128(w.detach()))[:, :160, :96]
    dyd = dequantize_1x128(*quantize_1x128(dy))[:, :160]
    expert = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    torch.testing.assert_close(y, torch.einsum("mk,mnk->mn", xd, wd[expert]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, torch.einsum("mn,mnk->mk", dyd, wd[expert]), rtol=1e-5, atol=1e-5)
    rows = torch.tensor(counts).cumsum(0).tolist()
    for e, (start, end) in enumerate(zip([0, *rows[:-1]], rows, strict=True)):
        if start == end:
            assert (w.grad[e] == 0).all()  # every expert gets a gradient, zero without tokens
            continue
        # weight gradient operands are quantized along tokens, in 128-token blocks within the expert
        dyt = dequantize_1x128(*quantize_1x128(dy[start:end].t()))
        xt = dequantize_1x128(*quantize_1x128(x.detach()[start:end].t()))
        torch.testing.assert_close(w.grad[e], dyt @ xt.t(), rtol=1e-5, atol=1e-5)


def test_fp8_swiglu_is_close_to_unquantized_and_not_identical():
    counts = torch.tensor([7, 0, 40, 17])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=g)
    ws = [torch.randn(4, 64, 128, generator=g) * 0.1, torch.randn(4, 64, 128, generator=g) * 0.1]
    ws.append(torch.randn(4, 128, 64, generator=g) * 0.1)
    y8 = fp8_grouped_swiglu(x, counts, *ws)
    y = grouped_swiglu_loop(x, counts, *ws)
    rel = ((y8 - y).norm() / y.norm()).item()
    assert 1e-4 < rel < 0.1, rel  # e4m3 noise: three GEMMs at ~3-5% each on random data


def _fake_sm90_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype):  # noqa: ANN001, ANN202
    """torch.nn.functional.scaled_mm on CPU: what torch 2.11 + cuBLASLt on an H200 refused (the row count, and
    torch's layout checks of its SM90 blockwise path, aten/src/ATen/native/cuda/ScaledBlas.cpp), then the
    product it defines, from the scales as laid out. Strides are compared exactly, size-1 dims included (a
    (256, 1) scale with strides (1, 1): `scale_a strides must be (1, 256); got: [1, 1]` on the H200)."""
    ST = F.ScalingType
    (m, k), n = a.shape, b.shape[1]
    kb = -(-k // BLOCK)
    kb4 = (kb + 3) // 4 * 4  # cuBLASLt pads the K blocks of 128x128 scales to a multiple of 4
    assert a.dtype == b.dtype == torch.float8_e4m3fn and k % 16 == 0 and n % 16 == 0 and b.shape[0] == k
    # H200: 1023, 1022, 129 and 2 rows -> CUBLAS_STATUS_NOT_SUPPORTED from cublasLtMatmulAlgoGetHeuristic
    assert m % 4 == 0, f"cuBLASLt has no blockwise fp8 algorithm for {m} rows (not a multiple of 4)"
    assert a.stride(1) == 1 and b.stride(0) == 1, "cuBLASLt on SM90: a row-major, b column-major"
    assert recipe_a == ST.BlockWise1x128 and scale_a.dtype == scale_b.dtype == torch.float32
    assert scale_a.shape == (m, kb) and scale_a.stride() == (1, m), f"scale_a strides {scale_a.stride()}"
    a_deq = a.float() * scale_a.repeat_interleave(BLOCK, dim=1)[:, :k]
    if recipe_b == ST.BlockWise128x128:
        nb = -(-n // BLOCK)
        # H200: `scale_b must have strides (1, 16); got [6, 1]` for a transposed view that was not padded
        assert scale_b.shape == (kb4, nb) and scale_b.stride() == (1, kb4), f"scale_b strides {scale_b.stride()}"
        full = scale_b[:kb].repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:k, :n]
    else:
        assert recipe_b == ST.BlockWise1x128
        assert scale_b.shape == (n, kb) and scale_b.stride() == (1, n), f"scale_b strides {scale_b.stride()}"
        full = scale_b.t().repeat_interleave(BLOCK, dim=0)[:k]
    return (a_deq @ (b.float() * full)).to(output_dtype)


def _swiglu_grads_reference_and_gpu_path(monkeypatch, counts: list[int], hidden: int, inter: int):  # noqa: ANN001, ANN202
    """x, w_gate, w_up, w_down gradients of fp8_grouped_swiglu through the reference path and through the
    GPU path with the checking stand-in for scaled_mm."""
    from prime_rl.trainer.models import moe_compute

    g = torch.Generator().manual_seed(3)
    e = len(counts)
    x = torch.randn(sum(counts), hidden, generator=g)
    ws = [torch.randn(e, inter, hidden, generator=g) * 0.1, torch.randn(e, inter, hidden, generator=g) * 0.1]
    ws.append(torch.randn(e, hidden, inter, generator=g) * 0.1)
    results = []
    for gpu_path in (False, True):
        monkeypatch.setattr(moe_compute, "sm90_scaled_mm_enabled", lambda device, on=gpu_path: on)
        monkeypatch.setattr(F, "scaled_mm", _fake_sm90_scaled_mm, raising=False)
        xd, wd = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in ws]
        y = fp8_grouped_swiglu(xd, torch.tensor(counts, dtype=torch.long), *wd)
        (y.square().mean() if y.numel() else y.sum()).backward()
        results.append([y.detach(), xd.grad, *(w.grad for w in wd)])
    return results


@pytest.mark.parametrize(
    "counts, hidden, inter",
    [
        # expert counts not multiples of 4 (cuBLASLt's refusal); 192 / 320: ragged 128-blocks, 2 and 3 K blocks
        ([5, 0, 131, 128, 22], 192, 320),
        # inter 512: 4 K blocks in the input gradient's GEMM, so w's transposed scales need no padding (the
        # case whose strides torch refused); counts multiples of 4 (and over 128), which alone did not help
        ([132, 260, 0, 136], 256, 512),
        # hidden 128: one K block, size-1 scale dims, whose strides torch also checks
        ([1, 2, 3, 257, 0, 130], 128, 256),
        # every count a whole 128-row block (no padding at all), and no tokens at all
        ([128, 0, 256], 256, 256),
        ([0, 0, 0], 256, 256),
    ],
    ids=["ragged", "k_blocks_multiple_of_4", "one_k_block", "no_padding", "no_tokens"],
)
def test_sm90_path_layouts_satisfy_torch_checks_and_match_the_reference(monkeypatch, counts, hidden, inter):
    """The GPU path's operand and scale layouts (the part a CPU cannot run), through a stand-in for
    scaled_mm that enforces what the H200 refused: the same numbers as the reference path."""
    reference, gpu_path = _swiglu_grads_reference_and_gpu_path(monkeypatch, counts, hidden, inter)
    for ref, got in zip(reference, gpu_path, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)


def test_expert_rows_pad_each_expert_to_whole_blocks_and_results_ignore_the_padding():
    counts = [3, 0, 130, 128, 5]
    rows = ExpertRows(counts, torch.device("cpu"))
    assert rows.padded == [128, 0, 256, 128, 128] and rows.num_padded == 640
    assert [(e, b.start, b.stop) for e, b in rows.blocks()] == [
        (0, 0, 128),
        (2, 128, 384),
        (3, 384, 512),
        (4, 512, 640),
    ]
    x = torch.arange(266.0)[:, None].expand(266, 2)
    xp = rows.pad(x)
    # each expert's rows at the start of its blocks, in order, zeros after them
    for (start, m), (_, block) in zip([(0, 3), (3, 130), (133, 128), (261, 5)], rows.blocks(), strict=True):
        torch.testing.assert_close(xp[block.start : block.start + m], x[start : start + m])
        assert (xp[block.start + m : block.stop] == 0).all()
    assert ExpertRows([128, 0, 256], torch.device("cpu")).index is None  # nothing to pad: x itself is used
    # the padded GEMMs give what the unpadded math gives: the dequantized per-expert products
    x, w = _expert_inputs(counts, k=256, n=128)
    y = FP8GroupedLinear.apply(x, w, rows)
    xd = dequantize_1x128(*quantize_1x128(x.detach()))
    wd = dequantize_128x128(*quantize_128x128(w.detach()))
    expert = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    torch.testing.assert_close(y, torch.einsum("mk,mnk->mn", xd, wd[expert]), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- a tiny MoE


def _loss_and_grads(model_dir, compute: str) -> tuple[float, dict[str, torch.Tensor]]:
    model = build_model(model_dir, attn="sdpa", dtype=torch.float32, device="cpu")
    load_hf_weights(model, model_dir)
    apply_moe_compute(model.layers, compute)
    ids = torch.randint(0, 96, (1, 257), generator=torch.Generator().manual_seed(1))
    logits = model.lm_head(model(ids[:, :-1], torch.arange(256)[None]))
    loss = F.cross_entropy(logits[0], ids[0, 1:])
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "overrides",
    [{}, {"hidden_size": 128, "moe_intermediate_size": 128, "num_experts": 8}],
    ids=["ragged_blocks", "whole_blocks"],
)
def test_tiny_qwen3_moe_fp8_loss_and_gradients_match_unquantized(hf_model_factory, overrides):
    _, path = hf_model_factory("qwen3_moe", **overrides)
    loss_ref, grads_ref = _loss_and_grads(path, "bf16")
    loss, grads = _loss_and_grads(path, "fp8")
    assert loss != loss_ref  # the experts really ran in fp8
    assert abs(loss - loss_ref) / loss_ref < LOSS_REL_TOL, (loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    flat, flat_ref = (torch.cat([g[n].flatten() for n in grads_ref]) for g in (grads, grads_ref))
    assert F.cosine_similarity(flat, flat_ref, dim=0) > ALL_GRADS_COS_MIN
    for name, g in grads_ref.items():
        if ".experts." in name:
            assert F.cosine_similarity(grads[name].flatten(), g.flatten(), dim=0) > EXPERT_GRAD_COS_MIN, name


# --------------------------------------------------------------------------- start-up


def test_start_up_accepts_bf16_and_fp8_off_the_gpu_and_warns_that_fp8_is_slow():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("trainer")
    # another test in this worker may have set the shared logger up quieter, or a logging.config call
    # (disable_existing_loggers) may have disabled it
    level, disabled = logger.level, logger.disabled
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.disabled = False
    try:
        check_moe_compute(BF16ComputeConfig(), "qwen3_moe", "cpu")
        assert records == []
        check_moe_compute(FP8ComputeConfig(), "qwen3_moe", "cpu")  # the reference path
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled
    assert [r.levelno for r in records] == [logging.WARNING]
    message = records[0].getMessage()
    assert 'x the time of type = "bf16"' in message and "grouped_gemm.md" in message and "\n" not in message


def test_start_up_fp8_on_sm90_with_triton_warns_that_its_speed_is_unmeasured(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("trainer")  # set up directly, as in the test above: shared and maybe quieted
    monkeypatch.setattr(logger, "disabled", False)
    monkeypatch.setattr(logger, "level", logging.WARNING)
    logger.addHandler(handler)
    try:
        check_moe_compute(FP8ComputeConfig(), "qwen3_moe", "cuda")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == [FP8_TRITON_WARNING]
    assert "not been measured on a GPU" in FP8_TRITON_WARNING and "\n" not in FP8_TRITON_WARNING
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(RuntimeError, match="needs an SM90 GPU .* found SM80"):
        check_moe_compute(FP8ComputeConfig(), "qwen3_moe", "cuda")


def test_fp8_path_choice_traces_into_one_graph():
    """The MoE block compiles as one graph with the Triton fp8 path, and the path is chosen inside it: the
    GPU-generation lookup must trace as a constant, not break the graph."""
    from prime_rl.trainer.models.moe_compute import fp8_triton_enabled

    fn = torch.compile(lambda x: x * (2 if fp8_triton_enabled("cuda") else 3), fullgraph=True, backend="eager")
    want = 2.0 if fp8_triton_enabled("cuda") else 3.0  # this machine's answer, eager
    assert fn(torch.ones(2)).tolist() == [want, want]


def test_deepgemm_fp8_refuses_in_one_line_naming_deep_gemm(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import deep_gemm -> ImportError, installed or not
    with pytest.raises(ImportError, match="needs the `deep_gemm` package") as e:
        check_moe_compute(DeepGEMMFP8ComputeConfig(), "qwen3_moe", "cpu")
    assert "\n" not in str(e.value) and 'type = "fp8"' in str(e.value)
    # importable: still refused (not wired in), no kernel call attempted
    monkeypatch.setitem(sys.modules, "deep_gemm", types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=None))
    with pytest.raises(ImportError, match="not wired into this trainer yet"):
        check_moe_compute(DeepGEMMFP8ComputeConfig(), "qwen3_moe", "cpu")


def test_mxfp8_refuses_in_one_line_naming_sm100():
    with pytest.raises(RuntimeError, match=r"needs an SM100 \(Blackwell\) GPU, found no CUDA GPU") as e:
        check_moe_compute(MXFP8ComputeConfig(), "qwen3_moe", "cpu")
    assert "\n" not in str(e.value)


def test_fp8_refuses_nemotron_h_relu2_experts():
    with pytest.raises(ValueError, match="not nemotron_h's relu\\^2 experts"):
        check_moe_compute(FP8ComputeConfig(), "nemotron_h", "cpu")


@pytest.mark.parametrize("compute", [MXFP8ComputeConfig(), DeepGEMMFP8ComputeConfig()], ids=lambda c: c.type)
def test_refusal_happens_in_layout_resolution_before_any_weight_is_read(hf_model_factory, monkeypatch, compute):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    _, path = hf_model_factory("qwen3_moe")
    for f in path.glob("*.safetensors"):
        f.unlink()  # nothing to read: the refusal must come first
    cfg = TrainerModelConfig(name=str(path), moe=MoEConfig(compute=compute))
    with pytest.raises((ImportError, RuntimeError), match=f'type = "{compute.type}"'):
        resolve_parallel_dims(cfg, 1, load_model_config(str(path)))


# --------------------------------------------------------------------------- GPU


def _gpu_vs_reference_rel_errors(fn, inputs: list[torch.Tensor]) -> list[float]:  # noqa: ANN001
    """fn(*inputs) and, for one fixed output gradient, the gradients of all inputs, in bf16 on the GPU
    (scaled_mm) and on the CPU (the dequantizing reference): per tensor |gpu - ref| / |ref| in norm. The
    output gradient is given, not derived from the output, so that the backward GEMMs of both paths get
    the same operands."""
    results, grad = [], None
    for device in ("cpu", "cuda"):
        leaves = [t.to(device, torch.bfloat16).requires_grad_() for t in inputs]
        y = fn(*leaves)
        if grad is None:
            grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)) * y.float().std().item()
        y.backward(grad.to(device, torch.bfloat16))
        results.append([t.float().cpu() for t in (y, *(leaf.grad for leaf in leaves))])
    return [((got - ref).norm() / ref.norm()).item() for ref, got in zip(*results, strict=True)]


requires_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or not sm90_scaled_mm_enabled(torch.device("cuda")),
    reason="needs an SM90 GPU and torch's blockwise scaled_mm",
)


@pytest.mark.gpu
@requires_sm90
def test_sm90_scaled_mm_each_gemm_matches_the_reference_path():
    """One FP8 grouped linear (forward, input and weight gradient): the same e4m3 payloads and scales on
    both paths, so only accumulation order and the bf16 output's rounding differ. Blocks of very different
    magnitude (rows, 128-column blocks, experts), so that a scale applied to the wrong block shows."""
    counts = [64, 0, 200, 37, 128, 3, 1]  # not multiples of 4, an empty expert, 1-3 weight-gradient blocks
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 512, generator=g) * torch.logspace(-2, 2, 4).repeat_interleave(BLOCK)
    x = x * torch.logspace(-1, 1, x.shape[0])[torch.randperm(x.shape[0], generator=g)][:, None]
    w = torch.randn(len(counts), 384, 512, generator=g) * torch.logspace(-2, 1, len(counts))[:, None, None]
    w[:, BLOCK : 2 * BLOCK] *= 30
    rows = ExpertRows(counts, torch.device("cuda"))
    cpu_rows = ExpertRows(counts, torch.device("cpu"))
    rels = _gpu_vs_reference_rel_errors(
        lambda x, w: FP8GroupedLinear.apply(x, w, rows if x.is_cuda else cpu_rows), [x, w]
    )
    print(f"rel err gpu vs reference: y {rels[0]:.2e}, dx {rels[1]:.2e}, dw {rels[2]:.2e}")
    assert max(rels) < 5e-3, rels  # bf16 output rounding is 2^-9 per element


@pytest.mark.gpu
@requires_sm90
@pytest.mark.parametrize("path", ["triton", "scaled_mm"])
def test_sm90_swiglu_matches_the_reference_path(path):
    """`fp8_grouped_swiglu` runs the Triton grouped kernels on SM90; `fp8_grouped_swiglu_torch` the per-expert
    scaled_mm fallback. Both against the dequantized reference on CPU."""
    fn = fp8_grouped_swiglu if path == "triton" else fp8_grouped_swiglu_torch
    counts = torch.tensor([64, 0, 200, 37, 128])  # ragged, an empty expert, a multi-block weight gradient
    g = torch.Generator().manual_seed(0)
    x = torch.randn(int(counts.sum()), 256, generator=g)
    ws = [torch.randn(5, 384, 256, generator=g) * 0.05, torch.randn(5, 384, 256, generator=g) * 0.05]
    ws.append(torch.randn(5, 256, 384, generator=g) * 0.05)
    rels = _gpu_vs_reference_rel_errors(
        lambda x, *ws: fn(x, counts, *ws) if x.is_cuda else fp8_grouped_swiglu(x, counts, *ws), [x, *ws]
    )
    print("rel err gpu vs reference: y, dx, dw_gate, dw_up, dw_down", [f"{r:.2e}" for r in rels])
    # looser than one GEMM: where the two paths' bf16 outputs of one GEMM differ by a rounding, the next
    # GEMM's e4m3 quantization of them can round to a neighbouring value, a whole e4m3 step (6-12%)
    assert max(rels) < 5e-2, rels
