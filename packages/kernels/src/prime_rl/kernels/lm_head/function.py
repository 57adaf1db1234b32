"""The LM head's autograd Function, one for both backends (torch_impl.py, triton_impl.py).

Forward keeps the inputs and two floats per token (lse and S, see math.py); backward hands them, with the
upstream gradients, to the backend's recompute-and-multiply loop. A backend is two callables: its forward
statistics and its backward, each with its own settings (chunk sizes) already bound.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch


class BackwardInputs(NamedTuple):
    """What a backend's backward reads: the forward's inputs and statistics, the upstream gradients (zero at
    ignored targets), and which input gradients autograd asks for."""

    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    lse: torch.Tensor
    sum_pz: torch.Tensor
    grad_logprobs: torch.Tensor
    grad_entropy: torch.Tensor
    inv_temperature: float
    need_hidden_grad: bool
    need_weight_grad: bool


Stats = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
ForwardStats = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], Stats]
"""(hidden, weight, targets, inv_temperature) -> (logprobs, entropy, lse, S), each [T]."""
Backward = Callable[[BackwardInputs], tuple[torch.Tensor | None, torch.Tensor | None]]
"""BackwardInputs -> (grad_hidden, grad_weight), None where not asked for."""


class LMHeadFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, stats: ForwardStats, backward: Backward):
        inv_t = 1.0 / temperature
        logprobs, entropy, lse, sum_pz = stats(hidden, weight, targets, inv_t)
        ctx.save_for_backward(hidden, weight, targets, lse, sum_pz)
        ctx.cfg = (inv_t, backward)
        return logprobs.float(), entropy.float()

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, sum_pz = ctx.saved_tensors
        inv_t, backward = ctx.cfg
        # logprob of an ignored target is the constant 0: no gradient flows from it.
        grad_logprobs = torch.where(targets >= 0, grad_logprobs, torch.zeros((), dtype=grad_logprobs.dtype))
        inputs = BackwardInputs(
            hidden, weight, targets, lse, sum_pz, grad_logprobs, grad_entropy, inv_t, *ctx.needs_input_grad[:2]
        )
        grad_hidden, grad_weight = backward(inputs)
        return grad_hidden, grad_weight, None, None, None, None
