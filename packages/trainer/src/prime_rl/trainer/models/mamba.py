"""Mamba-2 mixer over packed sequences: a document-aware causal conv1d and the chunked SSD scan in torch.

Design:
- Parameter names and shapes are transformers' `NemotronHMamba2Mixer` (`in_proj`, `conv1d`, `dt_bias`,
  `A_log`, `D`, `norm`, `out_proj`), so loading is a prefix change; the numerics follow its torch path
  (fp32 scan, dt clamped to the config's `time_step_limit`, gated RMSNorm per group of `n_groups`). The clamp
  is the one vLLM applies and transformers >= 5.25 too (default (0, inf)); transformers up to 5.24 clamped
  below at `time_step_min` (1e-3) instead, which made trainer and inference disagree slightly for a head
  whose softplus(dt) fell below it.
- Packed rows: the trainer concatenates documents and restarts positions at 0 for each one. Both the
  conv1d state and the SSM state restart at every document start, so a packed row gives exactly the
  outputs of its documents run one by one. Nothing reads host ints: the resets are masks built from
  `PackedSeqs.doc_ids` (the same idea as mamba_ssm's `seq_idx`), so the forward has no device sync and
  no per-document Python loop.
- The scan is the SSD chunked algorithm (Mamba-2 paper, section 6; mamba_ssm's `ssd_chunk_scan`
  reference): quadratic attention-like form inside chunks of `chunk_size` tokens, a linear recurrence
  of chunk-end states between chunks. A document boundary inside a chunk masks the intra-chunk
  decay matrix; across chunks a chunk-end state is kept only for the document still open there.

Cost: like transformers' torch path, it materializes (heads, T / chunk_size, chunk_size, chunk_size) fp32
decay and score tensors per layer (about 2 * 4 B * heads * chunk_size per token: 64 KiB at 64 heads and
chunk 128), so long rows want activation checkpointing; the inter-chunk step is quadratic in the chunk
count (a (heads, c, c) matrix) where mamba_ssm passes states sequentially.

Left out: a Triton / CUDA scan (mamba_ssm's fused kernels, which take the same resets as `seq_idx`),
inference caches (vLLM serves), context parallelism over the sequence (the scan would need the previous
rank's final state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prime_rl.trainer.models.config import ArchConfig
from prime_rl.trainer.models.packing import PackedSeqs


class GatedRMSNorm(nn.Module):
    """RMSNorm of x * silu(gate), normalized per group of `group_size` channels (HF Zamba2RMSNormGated)."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.eps, self.group_size = eps, group_size
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate (T, D) -> (T, D) in the promoted dtype of weight and x, as HF."""
        dtype = x.dtype
        x32 = x.float() * F.silu(gate.float())
        groups = x32.view(*x32.shape[:-1], -1, self.group_size)  # (T, G, D/G)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * groups.view_as(x32).to(dtype)


def causal_conv1d_packed(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, doc_ids: torch.Tensor
) -> torch.Tensor:
    """Depthwise causal conv over packed documents: a tap never reaches into the previous document.

    x (T, C), weight (C, 1, K) as nn.Conv1d stores it, doc_ids (T,) -> (T, C), before the activation.
    """
    num_tokens, kernel = x.shape[0], weight.shape[-1]
    w = weight.squeeze(1).to(x.dtype)  # (C, K); tap K-1 is the current token
    out = x * w[:, kernel - 1]
    for shift in range(1, kernel):
        past = F.pad(x, (0, 0, shift, 0))[:num_tokens]  # (T, C): x[t - shift], zeros before the row start
        same_doc = F.pad(doc_ids, (shift, 0), value=-1)[:num_tokens] == doc_ids  # (T,)
        out = out + past * same_doc.unsqueeze(-1).to(x.dtype) * w[:, kernel - 1 - shift]
    return out if bias is None else out + bias.to(x.dtype)


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """a (..., L) -> (..., L, L) with [i, j] = sum_{j < k <= i} a_k below the diagonal, 0 on it, -inf above.

    Masked cumsum rather than cumsum differences: no catastrophic cancellation (HF / mamba_ssm's form).
    """
    length = a.shape[-1]
    a = a.unsqueeze(-1).expand(*a.shape, length)  # [..., i, j] = a_i
    strictly_lower = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device), diagonal=-1)
    sums = torch.cumsum(a.masked_fill(~strictly_lower, 0), dim=-2)
    lower = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device))
    return sums.masked_fill(~lower, float("-inf"))


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    doc_ids: torch.Tensor,
    chunk_size: int,
) -> torch.Tensor:
    """y_t = C_t . h_t with h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T, h = 0 at every document start.

    x (T, h, p), dt (T, h), A (h,), B / C (T, g, n) with g dividing h, doc_ids (T,) non-decreasing (documents
    are contiguous, as PackedSeqs numbers them) -> y (T, h, p), all fp32 (no D skip term). Letters: c chunk, l / s positions in a chunk, h head, p head dim, n state.
    """
    num_tokens, heads, _ = x.shape
    B = B.repeat_interleave(heads // B.shape[1], dim=1)  # (T, h, n): head i reads group i // (h / g)
    C = C.repeat_interleave(heads // C.shape[1], dim=1)
    x = x * dt.unsqueeze(-1)  # discretized input
    a = dt * A  # (T, h) log decay per step
    pad = (-num_tokens) % chunk_size
    # padding tokens go last and belong to no document: they reach no real token
    doc = F.pad(doc_ids, (0, pad), value=-1).view(-1, chunk_size)  # (c, l)
    x, a, B, C = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (x, a, B, C))
    x, B, C = (t.view(-1, chunk_size, *t.shape[1:]) for t in (x, B, C))  # (c, l, h, .)
    a = a.view(-1, chunk_size, heads).permute(2, 0, 1)  # (h, c, l)
    a_cum = torch.cumsum(a, dim=-1)  # (h, c, l)

    # 1. inside each chunk: attention-like, decay-weighted C_l . B_s, only between tokens of one document
    same_doc = doc.unsqueeze(-1) == doc.unsqueeze(-2)  # (c, l, s)
    decay = torch.exp(segment_sum(a)) * same_doc  # (h, c, l, s)
    scores = torch.einsum("clhn,cshn->clsh", C, B) * decay.permute(1, 2, 3, 0)  # (c, l, s, h)
    y_diag = torch.einsum("clsh,cshp->clhp", scores, x)

    # 2. each chunk's end state, from the tokens of the document still open at its end
    start_doc, end_doc = doc[:, 0], doc[:, -1]  # (c,)
    to_end = torch.exp(a_cum[:, :, -1:] - a_cum) * (doc == end_doc.unsqueeze(-1))  # (h, c, l)
    chunk_states = torch.einsum("clhn,hcl,clhp->chpn", B, to_end, x)  # (c, h, p, n)

    # 3. state entering chunk c: chunk z's end state decayed over chunks z+1..c-1, if one document spans them
    totals = F.pad(a_cum[:, :, -1], (1, 0))  # (h, c + 1): index k = decay of chunk k - 1
    carry = torch.exp(segment_sum(totals))[:, :-1, 1:]  # (h, c_to, z_from): sum of totals over z+1..c-1
    carry = carry * (start_doc.unsqueeze(-1) == end_doc.unsqueeze(0))  # (h, c, z)
    start_states = torch.einsum("hcz,zhpn->chpn", carry, chunk_states)  # (c, h, p, n)

    # 4. the entering state's contribution to each token of the chunk's first document
    from_start = torch.exp(a_cum) * (doc == start_doc.unsqueeze(-1))  # (h, c, l)
    y_off = torch.einsum("clhn,chpn,hcl->clhp", C, start_states, from_start)

    return (y_diag + y_off).reshape(-1, heads, x.shape[-1])[:num_tokens]


class Mamba2Mixer(nn.Module):
    """in_proj -> (gate z, conv'd x B C, dt) -> SSD scan + D skip -> gated RMSNorm -> out_proj."""

    def __init__(self, config: ArchConfig):
        super().__init__()
        c = config
        self.num_heads, self.head_dim = c.mamba_num_heads, c.mamba_head_dim
        self.n_groups, self.state_size = c.mamba_n_groups, c.ssm_state_size
        self.chunk_size, self.time_step_limit = c.chunk_size, c.time_step_limit
        self.inner = self.num_heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.n_groups * self.state_size
        self.in_proj = nn.Linear(c.hidden_size, self.inner + self.conv_dim + self.num_heads, bias=c.mamba_proj_bias)
        # an nn.Conv1d only to hold HF's `conv1d.weight (C, 1, K)` / `conv1d.bias`: the forward is packed-aware
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, c.conv_kernel, groups=self.conv_dim, bias=c.use_conv_bias, padding=0
        )
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.norm = GatedRMSNorm(self.inner, self.inner // self.n_groups, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.inner, c.hidden_size, bias=c.mamba_proj_bias)

    def forward(self, x: torch.Tensor, seqs: PackedSeqs) -> torch.Tensor:
        """x (T, H) -> (T, H)."""
        num_tokens, dtype = x.shape[0], x.dtype
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        xbc = F.silu(causal_conv1d_packed(xbc, self.conv1d.weight, self.conv1d.bias, seqs.doc_ids))  # (T, conv_dim)
        xs, B, C = xbc.split([self.inner, self.n_groups * self.state_size, self.n_groups * self.state_size], dim=-1)
        # dt in the activation dtype up to the clamp, then fp32: HF's order, so bf16 runs agree too
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype)).clamp(*self.time_step_limit)  # (T, h)
        A = -torch.exp(self.A_log.float())  # (h,)
        xs = xs.reshape(num_tokens, self.num_heads, self.head_dim).float()  # (T, h, p)
        groups = (num_tokens, self.n_groups, self.state_size)
        y = ssd_chunk_scan(
            xs, dt.float(), A, B.reshape(groups).float(), C.reshape(groups).float(), seqs.doc_ids, self.chunk_size
        )
        y = y + self.D.unsqueeze(-1) * xs  # (T, h, p) fp32
        y = self.norm(y.reshape(num_tokens, self.inner), z)
        return self.out_proj(y.to(dtype))

    @torch.no_grad()
    def init_weights(self) -> None:
        """HF's init of what Transformer.init_weights does not cover (Linears, norms): the conv as torch
        initializes it, A = 1..num_heads, D = 1, dt = softplus(dt_bias) log-uniform in [1e-3, 1e-1]."""
        self.conv1d.reset_parameters()
        self.A_log.copy_(torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        self.D.fill_(1.0)
        dt = torch.exp(torch.rand(self.num_heads) * (torch.log(torch.tensor(0.1)) - torch.log(torch.tensor(1e-3))))
        dt = (dt * 1e-3).clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
