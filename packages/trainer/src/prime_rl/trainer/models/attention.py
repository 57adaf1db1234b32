"""Core attention backends over packed sequences with document masking.

Every backend is an `nn.Module` with one signature,
    forward(q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, D), seqs: PackedSeqs) -> (T, Hq, D),
causal within each document and never across documents. The transformer block holds one as
`self_attn.core_attention`, so context parallelism (ring attention) can replace it in place.

Backends:
- sdpa: torch SDPA; documents of one length (e.g. one per row) run as a batch with `is_causal` (on CUDA
  cuDNN first, then flash), uneven ones use a block-diagonal causal mask (T x T bool).
- flex: FlexAttention with a document-causal BlockMask (compiled on CUDA; eager forward only on CPU).
- varlen: `torch.nn.attention.varlen.varlen_attn` (CUDA, fp16/bf16).
- flash_attention_{2,3,4}: the flash-attn packages' varlen kernels (CUDA).
`auto` picks the first installed flash-attn (3, 4, 2), else varlen on CUDA, else sdpa. Under `auto` the
varlen backend hands equal-length documents to SDPA's dense causal path: on an H200 cuDNN's kernel is
faster than varlen's FA2 kernel (benchmarks/results/trainer.md).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from prime_rl.trainer.models.packing import PackedSeqs

ATTN_CHOICES = ("auto", "sdpa", "varlen", "flex", "flash_attention_2", "flash_attention_3", "flash_attention_4")

# (module to import, how to install it) per flash-attn version.
_FLASH_PACKAGES = {
    "flash_attention_2": ("flash_attn", "pip install flash-attn --no-build-isolation"),
    "flash_attention_3": (
        "flash_attn_interface",
        "build FlashAttention-3 from source: git clone https://github.com/Dao-AILab/flash-attention && "
        "cd flash-attention/hopper && pip install . --no-build-isolation",
    ),
    "flash_attention_4": ("flash_attn.cute", "pip install flash-attn-4"),
}
_AUTO_FLASH_ORDER = ("flash_attention_3", "flash_attention_4", "flash_attention_2")


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # a broken CUDA extension raises more than ImportError; treat it as absent
        return False
    return True


def resolve_attn(attn: str) -> str:
    """Turn the user's choice into a concrete backend name, failing early with the fix."""
    if attn not in ATTN_CHOICES:
        raise ValueError(f"attn={attn!r} is not a known attention backend; choose one of {', '.join(ATTN_CHOICES)}")
    if attn == "auto":
        if torch.cuda.is_available():
            for name in _AUTO_FLASH_ORDER:
                if _importable(_FLASH_PACKAGES[name][0]):
                    return name
            if _varlen_available():
                return "varlen"
        return "sdpa"
    if attn in _FLASH_PACKAGES:
        module, install = _FLASH_PACKAGES[attn]
        if not _importable(module):
            raise ImportError(f"attn={attn!r} needs the `{module}` module, which is not installed; {install}")
    if attn == "varlen" and not _varlen_available():
        raise ImportError(
            f"attn='varlen' needs torch.nn.attention.varlen (torch>=2.10); found torch {torch.__version__}"
        )
    return attn


def _varlen_available() -> bool:
    return _importable("torch.nn.attention.varlen")


def build_core_attention(attn: str, sdpa_fallback: bool = False) -> nn.Module:
    """attn must be resolved (no 'auto'). `sdpa_fallback` (set when the user chose 'auto') lets the
    varlen backend run fp32 or CPU inputs through SDPA instead of failing."""
    if attn == "sdpa":
        return SDPAAttention()
    if attn == "flex":
        return FlexAttention()
    if attn == "varlen":
        return VarlenAttention(sdpa_fallback)
    if attn in _FLASH_PACKAGES:
        return FlashAttention(attn)
    raise ValueError(f"attn={attn!r} is not a concrete backend; call resolve_attn first")


def prepare_masks(seqs: PackedSeqs, attn: str) -> None:
    """Build the backend's mask once per forward, outside the blocks, so that compiled or
    checkpointed blocks only read `seqs.cache` (no mask construction inside a traced region)."""
    if attn == "sdpa" or (attn == "varlen" and seqs.doc_ids.device.type != "cuda"):
        if not uniform_docs(seqs):
            document_causal_mask(seqs)
    elif attn == "flex":
        FlexAttention.block_mask(seqs)


def _to_bhtd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # (T, H, D) -> (1, H, T, D)


def _from_bhtd(x: torch.Tensor) -> torch.Tensor:
    return x.squeeze(0).transpose(0, 1)  # (1, H, T, D) -> (T, H, D)


def document_causal_mask(seqs: PackedSeqs) -> torch.Tensor:
    """(T, T) bool: query i sees key j iff same document and j <= i."""
    if "sdpa_mask" not in seqs.cache:
        doc = seqs.doc_ids
        idx = torch.arange(doc.numel(), device=doc.device)
        seqs.cache["sdpa_mask"] = (doc[:, None] == doc[None, :]) & (idx[:, None] >= idx[None, :])
    return seqs.cache["sdpa_mask"]


# SDPA kernels to try on CUDA, in order: cuDNN's fused attention is the fastest on Hopper for long causal
# rows (the default order puts flash first); flash takes over where cuDNN refuses a shape.
SDPA_CUDA_PRIORITY = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


def uniform_docs(seqs: PackedSeqs) -> bool:
    """True when every document has the same length (one full document per row is the common case)."""
    return seqs.num_docs * seqs.max_seqlen == seqs.num_tokens


def is_gqa(q: torch.Tensor, k: torch.Tensor) -> bool:
    """(T, H, D) inputs with fewer key than query heads, as a Python bool. Under compile with dynamic shapes the
    comparison is a SymBool, which SDPA's `enable_gqa` refuses (Nemotron-H failed so on an H200) and `bool()`
    keeps symbolic; a branch makes Dynamo guard on the head counts and return a constant."""
    if q.shape[1] != k.shape[1]:
        return True
    return False


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_docs: int) -> torch.Tensor:
    """(T, H, D) packed documents of equal length T / num_docs -> causal SDPA over a (num_docs, H, L, D) batch."""
    num_tokens, gqa = q.shape[0], is_gqa(q, k)
    length = num_tokens // num_docs

    def to_batch(x: torch.Tensor) -> torch.Tensor:
        return x.view(num_docs, length, x.shape[1], x.shape[2]).transpose(1, 2)  # (N, H, L, D)

    with sdpa_kernel(SDPA_CUDA_PRIORITY, set_priority=True) if q.is_cuda else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(to_batch(q), to_batch(k), to_batch(v), is_causal=True, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(num_tokens, q.shape[1], out.shape[-1])


class SDPAAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs) -> torch.Tensor:
        if uniform_docs(seqs):
            return dense_causal_attention(q, k, v, seqs.num_docs)
        mask = document_causal_mask(seqs)
        gqa = is_gqa(q, k)
        out = F.scaled_dot_product_attention(_to_bhtd(q), _to_bhtd(k), _to_bhtd(v), attn_mask=mask, enable_gqa=gqa)
        return _from_bhtd(out)


@functools.cache
def _compiled_flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    # Uncompiled flex materializes the full score matrix; compiled it is a fused kernel.
    return torch.compile(flex_attention, dynamic=False)


class FlexAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        block_mask = self.block_mask(seqs)
        fn = _compiled_flex() if q.is_cuda else flex_attention
        out = fn(_to_bhtd(q), _to_bhtd(k), _to_bhtd(v), block_mask=block_mask, enable_gqa=is_gqa(q, k))
        return _from_bhtd(out)

    @staticmethod
    def block_mask(seqs: PackedSeqs):
        if "flex_block_mask" not in seqs.cache:
            from torch.nn.attention.flex_attention import create_block_mask

            doc = seqs.doc_ids

            def document_causal(b, h, q_idx, kv_idx):
                return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

            n = seqs.num_tokens
            seqs.cache["flex_block_mask"] = create_block_mask(document_causal, None, None, n, n, device=doc.device)
        return seqs.cache["flex_block_mask"]


@functools.cache
def _varlen_kwargs() -> tuple[dict, bool]:
    """torch 2.10 takes is_causal=True; 2.11+ takes window_size=(-1, 0). enable_gqa arrived later still."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return causal, "enable_gqa" in params


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)  # (T, Hkv, D) -> (T, Hkv * n_rep, D)


class VarlenAttention(nn.Module):
    def __init__(self, sdpa_fallback: bool = False):
        super().__init__()
        self.sdpa_fallback = sdpa_fallback
        """attn='auto': run fp32 / CPU inputs and equal-length documents through SDPA (faster there)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs) -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        if self.sdpa_fallback and uniform_docs(seqs):
            return dense_causal_attention(q, k, v, seqs.num_docs)
        if q.dtype not in (torch.float16, torch.bfloat16) or not q.is_cuda:
            if self.sdpa_fallback:
                return SDPAAttention()(q, k, v, seqs)
            raise RuntimeError(
                f"attn='varlen' runs on CUDA in fp16/bf16, got {q.dtype} on {q.device}; "
                "use attn='sdpa' (or 'auto') for fp32 or CPU"
            )
        causal, has_gqa = _varlen_kwargs()
        n_rep = q.shape[1] // k.shape[1]
        kwargs = dict(causal)
        if n_rep > 1 and has_gqa:
            kwargs["enable_gqa"] = True
        elif n_rep > 1:
            k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
        cu, m = seqs.cu_seqlens, seqs.max_seqlen
        return varlen_attn(q, k, v, cu, cu, m, m, **kwargs)


class FlashAttention(nn.Module):
    """flash-attn 2 / 3 / 4 varlen kernels; they take (T, H, D) and handle GQA natively."""

    def __init__(self, version: str):
        super().__init__()
        self.version = version

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs) -> torch.Tensor:
        module = importlib.import_module(_FLASH_PACKAGES[self.version][0])
        flash_attn_varlen_func = getattr(module, "flash_attn_varlen_func", None)
        if flash_attn_varlen_func is None:  # some flash-attn-4 builds only export it from .interface
            flash_attn_varlen_func = importlib.import_module("flash_attn.cute.interface").flash_attn_varlen_func
        cu, m = seqs.cu_seqlens, seqs.max_seqlen
        out = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m, causal=True
        )
        # FA3 / FA4 builds return (out, lse) in some versions.
        return out[0] if isinstance(out, tuple) else out
