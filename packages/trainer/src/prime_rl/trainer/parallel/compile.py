"""Regional torch.compile: each transformer block separately (compiles once, reused by every layer,
and keeps FSDP's per-block hooks outside the compiled graphs).

`model.compile = "auto"` (the default) compiles on CUDA only (`resolve_compile`).

`fullgraph = true` asks for one graph per compiled region. An MoE layer whose token dispatch reads
split sizes on the host (expert-parallel all-to-all, DeepEP, or the per-expert loop off the GPU)
cannot be one graph, so such blocks are compiled around the experts instead, as torchtitan does:
every child of the block, and every child of the MoE but its experts, is one full graph; the
dispatch, the experts' collectives and the residual adds run eagerly between them. With the Triton
grouped GEMM on the GPU and no EP the whole MoE block is one graph.
"""

from typing import Literal

from torch import nn

from prime_rl.common.config.trainer import CompileConfig


def resolve_compile(cfg: CompileConfig | Literal["auto"] | None, device_type: str) -> CompileConfig | None:
    """`model.compile = "auto"`: on for CUDA, where regional compile measured +13-29% tokens/s on the RL
    trainer's packed rows (BENCHMARKS.md); off on CPU, where Inductor's build only adds start-up."""
    if cfg == "auto":
        return CompileConfig() if device_type == "cuda" else None
    return cfg


def apply_compile(blocks: nn.ModuleList, fullgraph: bool, moe_is_one_graph: bool) -> None:
    for block in blocks:
        # in place (nn.Module.compile), not torch.compile(block): a wrapping OptimizedModule would add
        # `_orig_mod.` to every parameter name and break weight loading / checkpoints. The compiled call
        # goes through block.forward, so an AC-wrapped forward is compiled with its checkpoint.
        moe = getattr(block, "mlp", None)
        if fullgraph and not moe_is_one_graph and hasattr(moe, "experts"):
            _compile_around_experts(block, moe)
        else:
            block.compile(fullgraph=fullgraph)


def _compile_around_experts(block: nn.Module, moe: nn.Module) -> None:
    for child in block.children():
        if child is not moe:
            child.compile(fullgraph=True)
    for name, child in moe.named_children():
        if name != "experts":
            child.compile(fullgraph=True)
