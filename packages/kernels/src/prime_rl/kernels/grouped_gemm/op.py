"""`grouped_mm(a, b, ends, tile_expert, tile_row)`: the Triton grouped GEMM as a torch custom op with autograd.

    a (M, K) rows grouped by expert, b (E, K, N), ends (E,) int32 cumulative row counts -> (M, N)
    tile_expert, tile_row = tile_map(ends, M): which expert and first row each 128-row tile has
    backward: da = grouped_mm(grad, b^T, ...), db[e] = a[rows of e]^T @ grad[rows of e]

Custom ops (torch.library) keep torch.compile(fullgraph=True) whole around the MoE layer: the compiler
sees one opaque op with a known output shape instead of a data-dependent loop over experts.
"""

import torch
import triton

from prime_rl.kernels.grouped_gemm.triton_kernels import MM_BLOCK_M, grouped_mm_kernel, grouped_mm_wgrad_kernel


def tile_map(ends: torch.Tensor, num_rows: int, block_rows: int = MM_BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(T,) expert and (T,) first row of every row tile of `block_rows` rows, T = cdiv(M, block_rows) + E
    (the worst case); tiles past the last real one get expert E. Device ops only: no host sync."""
    num_experts = ends.shape[0]
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tiles = (counts + block_rows - 1) // block_rows
    tile_ends = torch.cumsum(tiles, 0)
    t = torch.arange(triton.cdiv(num_rows, block_rows) + num_experts, device=ends.device, dtype=ends.dtype)
    expert = torch.searchsorted(tile_ends, t, right=True)  # (T,) in [0, E]
    e = expert.clamp(max=num_experts - 1)
    row = (ends[e] - counts[e]) + (t - (tile_ends[e] - tiles[e])) * block_rows
    return expert.to(torch.int32), row.to(torch.int32)


@torch.library.custom_op("prime_rl::grouped_mm", mutates_args=())
def grouped_mm(
    a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, tile_expert: torch.Tensor, tile_row: torch.Tensor
) -> torch.Tensor:
    M, K = a.shape
    E, _, N = b.shape
    out = a.new_empty(M, N)
    if M == 0:
        return out

    def grid(meta: dict) -> tuple[int, int]:
        return tile_expert.shape[0], triton.cdiv(N, meta["BLOCK_N"])

    grouped_mm_kernel[grid](
        a, b, out, ends, tile_expert, tile_row, N, K, E, *a.stride(), *b.stride(), *out.stride(), BLOCK_M=MM_BLOCK_M
    )
    return out


@grouped_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, tile_expert: torch.Tensor, tile_row: torch.Tensor):
    return a.new_empty(a.shape[0], b.shape[2])


@torch.library.custom_op("prime_rl::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """(E, K, N): per group, a[rows]^T @ b[rows]; zero for an empty group."""
    (M, K), N, E = a.shape, b.shape[1], ends.shape[0]
    out = a.new_empty(E, K, N)
    if M == 0:
        return out.zero_()

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(K, meta["BLOCK_K"]) * triton.cdiv(N, meta["BLOCK_N"]), E

    grouped_mm_wgrad_kernel[grid](a, b, out, ends, N, K, E, *a.stride(), *b.stride(), *out.stride())
    return out


@grouped_mm_wgrad.register_fake
def _(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return a.new_empty(ends.shape[0], a.shape[1], b.shape[1])


def _setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:  # noqa: ANN001
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
    a, b, ends, tile_expert, tile_row = ctx.saved_tensors
    da = grouped_mm(grad, b.transpose(-2, -1), ends, tile_expert, tile_row) if ctx.needs_input_grad[0] else None
    db = grouped_mm_wgrad(a, grad, ends) if ctx.needs_input_grad[1] else None
    return da, db, None, None, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)
