"""Blockwise-FP8 Triton grouped GEMM in the interpreter (CPU): quantizers bit for bit against the torch
reference, forward / input gradient / weight gradient against float64 of the same quantized math, the
SwiGLU's error against unquantized float64 beside bf16's, and the custom op's opcheck + fullgraph compile.
The checks live in grouped_gemm_fp8_cases.py, run in a fresh process because TRITON_INTERPRET must be set
before triton is imported."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_fp8_triton_kernels_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = Path(__file__).with_name("grouped_gemm_fp8_cases.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 7, proc.stdout


def _compile_sm90(fn, types: dict[str, str], constexprs: dict, **options) -> str:  # noqa: ANN001
    """PTX of `fn` compiled for SM90 (no GPU needed: the compiler and ptxas ship with triton)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    while type(fn).__name__ != "JITFunction":  # autotuned kernels wrap the JITFunction
        fn = fn.fn
    signature = {n: types.get(n, "i32") for n in fn.arg_names if n not in constexprs}
    signature |= dict.fromkeys(constexprs, "constexpr")
    compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.asm["ptx"]


def test_fp8_kernels_compile_for_sm90_and_the_gemms_use_wgmma():
    """The interpreter accepts code the GPU compiler refuses (non-constexpr globals, unsupported fp8 ops), and
    no GPU is here: compile each kernel for SM90 to PTX. The GEMMs must lower to wgmma: Hopper's fp8 wgmma
    needs operands contiguous along the contraction, which the payload layouts are chosen for."""
    pytest.importorskip("triton.backends.nvidia")
    k = pytest.importorskip("prime_rl.kernels.grouped_gemm.fp8_triton_kernels")
    fp8, f32, bf16, i32 = "*fp8e4nv", "*fp32", "*bf16", "*i32"
    tiles = dict(ends_ptr=i32, tile_expert_ptr=i32, tile_row_ptr=i32)
    quant = dict(x_ptr=bf16, q_ptr=fp8, s_ptr=f32, qt_ptr=fp8, st_ptr=f32, **tiles)
    _compile_sm90(k.quantize_rows_kernel, quant, {"ROWWISE": True, "COLWISE": True}, num_warps=8)
    _compile_sm90(k.quantize_weight_kernel, dict(w_ptr=bf16, q_ptr=fp8, s_ptr=f32), {}, num_warps=8)
    mm = dict(a_ptr=fp8, as_ptr=f32, b_ptr=fp8, bs_ptr=f32, out_ptr=bf16, **tiles)
    assert "wgmma" in _compile_sm90(k.fp8_grouped_mm_kernel, mm, {"BLOCK_N": 128}, num_warps=8, num_stages=3)
    wgrad = dict(at_ptr=fp8, ats_ptr=f32, bt_ptr=fp8, bts_ptr=f32, out_ptr=bf16, ends_ptr=i32, first_tile_ptr=i32)
    ptx = _compile_sm90(k.fp8_grouped_wgrad_kernel, wgrad, {"BLOCK_N": 128, "BLOCK_K": 128}, num_warps=8)
    assert "wgmma" in ptx
