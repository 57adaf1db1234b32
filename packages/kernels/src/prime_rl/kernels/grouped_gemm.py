"""SwiGLU expert MLP over tokens grouped by expert: one grouped GEMM per projection.

    x (M, H) sorted by expert, counts (E,) tokens per expert, w_gate / w_up (E, I, H), w_down (E, H, I)
    y[rows of e] = (silu(x_e @ w_gate[e].T) * (x_e @ w_up[e].T)) @ w_down[e].T

On CUDA with bf16 operands it uses `torch._grouped_mm` (one CUTLASS grouped kernel per projection,
with autograd); elsewhere a loop of per-expert matmuls, which is the reference the GPU path is tested
against. Every weight always joins the autograd graph (a zero-cost term when no token arrived), so
gradient hooks fire on every rank whatever the routing.
"""

import torch
import torch.nn.functional as F


def grouped_mm_available(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def grouped_swiglu_loop(
    x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    outputs = []
    for e, chunk in enumerate(torch.split(x, counts.tolist(), dim=0)):
        if chunk.numel() == 0:
            continue
        hidden = F.silu(chunk @ w_gate[e].t()) * (chunk @ w_up[e].t())  # (m, I)
        outputs.append(hidden @ w_down[e].t())  # (m, H)
    if not outputs:
        return x.new_zeros(x.shape) + 0.0 * (w_gate.sum() + w_up.sum() + w_down.sum())
    return torch.cat(outputs, dim=0)


def grouped_swiglu_grouped_mm(
    x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)  # (E,) end row of each expert's group
    gate = torch._grouped_mm(x, w_gate.transpose(-2, -1), offs=offs)  # (M, I)
    up = torch._grouped_mm(x, w_up.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(F.silu(gate) * up, w_down.transpose(-2, -1), offs=offs)  # (M, H)


def grouped_swiglu(
    x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    if grouped_mm_available(x) and x.shape[0] > 0:
        return grouped_swiglu_grouped_mm(x, counts, w_gate, w_up, w_down)
    return grouped_swiglu_loop(x, counts, w_gate, w_up, w_down)
