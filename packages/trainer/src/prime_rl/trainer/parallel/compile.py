"""Regional torch.compile: each transformer block separately (compiles once, reused by every layer,
and keeps FSDP's per-block hooks outside the compiled graphs)."""

from torch import nn


def apply_compile(blocks: nn.ModuleList, fullgraph: bool) -> None:
    for block in blocks:
        # in place (nn.Module.compile), not torch.compile(block): a wrapping OptimizedModule would add
        # `_orig_mod.` to every parameter name and break weight loading / checkpoints. The compiled call
        # goes through block.forward, so an AC-wrapped forward is compiled with its checkpoint.
        block.compile(fullgraph=fullgraph)
