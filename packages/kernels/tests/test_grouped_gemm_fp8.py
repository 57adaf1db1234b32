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
    assert proc.stdout.count("ok ") == 6, proc.stdout
