"""Grouped GEMMs for routed experts: Triton on GPU, a per-expert loop as the reference."""

from prime_rl.kernels.grouped_gemm.swiglu import (
    grouped_swiglu,
    grouped_swiglu_loop,
    grouped_swiglu_triton,
    triton_grouped_available,
    triton_grouped_enabled,
)

__all__ = [
    "grouped_swiglu",
    "grouped_swiglu_loop",
    "grouped_swiglu_triton",
    "triton_grouped_available",
    "triton_grouped_enabled",
]
