"""Routed-expert GEMM precision (`[model.moe.compute]`): the start-up checks.

Design:
- `type = "bf16"` (default) is the only precision that runs: the grouped GEMM of
  `prime_rl.kernels.grouped_gemm` (Triton on CUDA), which `Experts` and the expert-parallel experts call.
- `type = "deepgemm_fp8"` (DeepGEMM's grouped kernels) and `type = "mxfp8"` (SM100) refuse at start-up,
  naming what is missing, as Mega MoE dispatch does: no untested kernel path is shipped for them. `sft`,
  `trainer` and `rl` refuse them before torchrun starts (`common.dispatch_kernels.compute_kernels_error`).
- Left out: `type = "fp8"` (blockwise-scaled FP8 through our Triton grouped kernels, and before that a
  per-expert loop of torch's `scaled_mm`) was removed: it measured 2.36x slower than bf16 forward + backward
  on an H200 (9-16x for the per-expert loop) where issue #32 asked for 1.3x faster
  (benchmarks/results/grouped_gemm.md). The config refuses it (`FP8_COMPUTE_REMOVED`).
"""

from __future__ import annotations

import torch

from prime_rl.common.config.trainer import DeepGEMMFP8ComputeConfig, MoEComputeConfig
from prime_rl.common.dispatch_kernels import compute_kernels_error


def check_moe_compute(compute: MoEComputeConfig, device_type: str | None = None) -> None:
    """Fail at start-up, before any weight is read, with one line naming what this choice is missing (the line
    `sft` / `trainer` / `rl` print before torchrun, `compute_kernels_error`; for "mxfp8" the GPU found here).
    `device_type` None: this process's device (CUDA if visible)."""
    error = compute_kernels_error(compute.type)
    if error is None:
        return
    if isinstance(compute, DeepGEMMFP8ComputeConfig):
        raise ImportError(error)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    capability = torch.cuda.get_device_capability() if device_type == "cuda" else None
    if not capability or capability[0] != 10:
        where = f"SM{capability[0]}{capability[1]}" if capability else f"no CUDA GPU ({device_type})"
        error = f'[model.moe.compute] type = "mxfp8" needs an SM100 (Blackwell) GPU, found {where}; use type = "bf16"'
    raise RuntimeError(error)
