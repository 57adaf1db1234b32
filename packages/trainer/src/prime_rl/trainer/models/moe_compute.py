"""Routed-expert GEMM precision (`[model.moe.compute]`): the start-up checks.

Design:
- `type = "bf16"` (default) is the only precision that runs: the grouped GEMM of
  `prime_rl.kernels.grouped_gemm` (Triton on CUDA), which `Experts` and the expert-parallel experts call.
- `type = "deepgemm_fp8"` (DeepGEMM's grouped kernels) and `type = "mxfp8"` (SM100) refuse at start-up,
  naming what is missing, as Mega MoE dispatch does: no untested kernel path is shipped for them.
- Left out: `type = "fp8"` (blockwise-scaled FP8 through our Triton grouped kernels, and before that a
  per-expert loop of torch's `scaled_mm`) was removed: it measured 2.36x slower than bf16 forward + backward
  on an H200 (9-16x for the per-expert loop) where issue #32 asked for 1.3x faster
  (benchmarks/results/grouped_gemm.md). The config refuses it (`FP8_COMPUTE_REMOVED`).
"""

from __future__ import annotations

import importlib

import torch

from prime_rl.common.config.trainer import DeepGEMMFP8ComputeConfig, MoEComputeConfig, MXFP8ComputeConfig


def check_moe_compute(compute: MoEComputeConfig, device_type: str | None = None) -> None:
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
            'importable); install DeepGEMM, or use type = "bf16"'
            if missing
            else '[model.moe.compute] type = "deepgemm_fp8" is not wired into this trainer yet; use type = "bf16"'
        )
    if isinstance(compute, MXFP8ComputeConfig):
        raise RuntimeError(
            f'[model.moe.compute] type = "mxfp8" needs an SM100 (Blackwell) GPU, found {where}; use type = "bf16"'
            if not capability or capability[0] != 10
            else '[model.moe.compute] type = "mxfp8" is not wired into this trainer yet; use type = "bf16"'
        )


def _missing(module: str, attrs: tuple[str, ...]) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception:  # a broken CUDA extension raises more than ImportError
        return module
    absent = [f"{module}.{a}" for a in attrs if not hasattr(mod, a)]
    return ", ".join(absent) or None
