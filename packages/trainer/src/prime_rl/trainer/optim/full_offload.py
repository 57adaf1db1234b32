"""Full CPU offload (`model.offload = "full"`): the accelerator holds only bf16 compute weights.

- fp32 masters and fp32 gradient accumulators of each rank's parameter shard live in (pinned) CPU
  memory, with the optimizer state (AdamW moments; SignSGD has none: 8 instead of 16 bytes/param).
- A post-accumulate-grad hook moves each gradient to its CPU accumulator as soon as backward has
  produced it (after FSDP's reduce-scatter) and frees it on the device, so gradients never pile up
  in GPU memory across layers or micro-batches.
- `step()` runs the optimizer on CPU over chunks of parameters and copies each chunk's updated
  masters back into the bf16 device shards.

Gradient clipping is disabled (the global norm would need every gradient before any step; the
trainer warns once); `grad_norm()` still reports the global norm from the accumulators.
Left out: DCP checkpoints of this optimizer's CPU state, and overlapping the CPU step with backward.
"""

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from prime_rl.common.config.trainer import AdamWConfig, SignSGDConfig
from prime_rl.common.weight_sync.pinned import pinned_empty
from prime_rl.trainer.optim.optimizer import build_optimizer

CHUNK_NUMEL = 1 << 26  # parameters per CPU optimizer call: bounds the temporaries of foreach ops


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class FullOffloadOptimizer(torch.optim.Optimizer):
    def __init__(self, params: Iterable[torch.nn.Parameter], cfg: AdamWConfig | SignSGDConfig):
        self.params = [p for p in params if p.requires_grad]
        pin = torch.cuda.is_available()
        # exact-size pinned masters (`pinned_empty`): `pin_memory()` rounds each up to a power of two
        self.masters = [pinned_empty(_local(p).shape, torch.float32, pin=pin) for p in self.params]
        for m, p in zip(self.masters, self.params, strict=True):
            m.copy_(_local(p).detach())
        for m in self.masters:
            m.grad = torch.zeros_like(m)
        self.inner = build_optimizer(cfg, self.masters)
        torch.optim.Optimizer.__init__(self, self.masters, self.inner.defaults)
        # share the inner optimizer's groups and state: the LR scheduler writes lr here, DCP reads state
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.has_grad = [False] * len(self.params)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._offload_grad(i, p))

    @torch.no_grad()
    def _offload_grad(self, i: int, p: torch.nn.Parameter) -> None:
        self.masters[i].grad.add_(_local(p.grad).to("cpu", torch.float32))
        self.has_grad[i] = True
        p.grad = None  # free the device gradient now

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        assert closure is None, "FullOffloadOptimizer does not support closures"
        group = self.inner.param_groups[0]
        all_params = group["params"]
        try:
            start = 0
            while start < len(all_params):  # CPU chunks: run the optimizer on a slice of the masters
                end, numel = start, 0
                while end < len(all_params) and (numel == 0 or numel + all_params[end].numel() <= CHUNK_NUMEL):
                    numel += all_params[end].numel()
                    end += 1
                active = [m for m, seen in zip(all_params[start:end], self.has_grad[start:end], strict=True) if seen]
                group["params"] = active
                if active:
                    self.inner.step()
                for j in range(start, end):
                    _local(self.params[j]).copy_(self.masters[j], non_blocking=True)
                start = end
        finally:
            group["params"] = all_params

    def zero_grad(self, set_to_none: bool = True) -> None:  # accumulators are reused, never freed
        for m in self.masters:
            m.grad.zero_()
        self.has_grad = [False] * len(self.params)

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the accumulated gradients (shards summed over ranks)."""
        sq = sum((m.grad.double().pow(2).sum() for m in self.masters), torch.zeros((), dtype=torch.float64))
        if dist.is_initialized():
            device = self.params[0].device if self.params else torch.device("cpu")
            sq = sq.to(device)
            dist.all_reduce(sq)
        return sq.sqrt().float().cpu()
