"""Regional torch.compile: each transformer block separately (compiles once, reused by every layer,
and keeps FSDP's per-block hooks outside the compiled graphs)."""

import torch
from torch import nn


def apply_compile(blocks: nn.ModuleList, fullgraph: bool) -> None:
    for i, block in enumerate(blocks):
        blocks.register_module(str(i), torch.compile(block, fullgraph=fullgraph))
