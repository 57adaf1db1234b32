"""SwiGLU expert MLP over tokens grouped by expert: one grouped GEMM per projection.

    x (M, H) sorted by expert, counts (E,) tokens per expert, w_gate / w_up (E, I, H), w_down (E, H, I)
    y[rows of e] = (silu(x_e @ w_gate[e].T) * (x_e @ w_up[e].T)) @ w_down[e].T

On CUDA with bf16/fp16 operands it runs the Triton grouped GEMM (`op.grouped_mm`, three launches
forward, six backward, no host sync). Elsewhere a loop of per-expert matmuls, the reference the
Triton path is tested against. Every weight always gets a gradient (zero for an expert that got no
token), so gradient hooks fire on every rank whatever the routing.
"""

import torch
import torch.nn.functional as F

try:  # resolved at import, not per call: a cached lookup inside a compiled region makes Dynamo warn
    from prime_rl.kernels.grouped_gemm.op import grouped_mm, tile_map
except ImportError:  # no triton: the loop is the only path
    grouped_mm = tile_map = None


def triton_grouped_enabled(device_type: str) -> bool:
    """Whether routed experts on this device type run the Triton grouped GEMM (given bf16/fp16 operands)."""
    return device_type == "cuda" and grouped_mm is not None


def triton_grouped_available(x: torch.Tensor) -> bool:
    return triton_grouped_enabled(x.device.type) and x.dtype in (torch.bfloat16, torch.float16)


def grouped_swiglu_loop(
    x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    outputs = []
    for e, chunk in enumerate(torch.split(x, counts.tolist(), dim=0)):
        if chunk.numel() == 0:
            continue
        hidden = F.silu(chunk @ w_gate[e].t()) * (chunk @ w_up[e].t())  # (m, I)
        outputs.append(hidden @ w_down[e].t())  # (m, H)
    if not outputs:  # no token at all: a zero-cost term still gives every weight a gradient
        return x.new_zeros(x.shape) + 0.0 * (w_gate.sum() + w_up.sum() + w_down.sum())
    return torch.cat(outputs, dim=0)


def grouped_swiglu_triton(
    x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    ends = torch.cumsum(counts, dim=0, dtype=torch.int32)  # (E,) end row of each expert's group
    tiles = tile_map(ends, x.shape[0])  # shared by the 3 projections and their input gradients
    gate = grouped_mm(x, w_gate.transpose(-2, -1), ends, *tiles)  # (M, I)
    up = grouped_mm(x, w_up.transpose(-2, -1), ends, *tiles)
    return grouped_mm(F.silu(gate) * up, w_down.transpose(-2, -1), ends, *tiles)  # (M, H)


def grouped_swiglu(
    x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    if triton_grouped_available(x):
        return grouped_swiglu_triton(x, counts, w_gate, w_up, w_down)
    return grouped_swiglu_loop(x, counts, w_gate, w_up, w_down)
