"""Throughput, MFU and peak memory.

MFU = (tokens/s per GPU x model FLOPs per token) / the GPU's dense bf16 peak. FLOPs per token come
from the model (6N + attention at the packed row length, torchtitan's formula), so packed rows of
short documents over-count attention slightly: MFU is an upper-bound estimate in that case. Peak
FLOPs are looked up from the device name; an unknown GPU or a CPU reports MFU as 0 (never crashes).
"""

import resource
import time

import torch

# dense bf16 tensor-core peak, FLOP/s (no sparsity)
PEAK_BF16_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "B300": 2250e12,
    "GB200": 2500e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "RTX 4090": 165e12,
}


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of this device, or None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    # longest key first so "GH200" wins over "H200"
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated accelerator memory; on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class StepTimer:
    """Wall time of one step, waiting for the work queued on the current stream so its kernels count.

    Only the current stream is waited for: copies on side streams (optimizer-state offload, weight
    publication) keep running across the step boundary, which is the point of putting them there.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.t0 = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).record_event().synchronize()

    def start(self) -> None:
        self._sync()
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        self._sync()
        return time.perf_counter() - self.t0


def perf_metrics(
    num_tokens: int, step_time: float, world_size: int, flops_per_token: float, device: torch.device
) -> dict[str, float]:
    """num_tokens: tokens processed by all ranks in the step, as the objective counts them: RL counts real
    tokens (positions of samples up to each row's last loss sample; padding and trimmed tails excluded), SFT every
    position of its packed rows. `perf/throughput` is num_tokens / step_time."""
    throughput = num_tokens / step_time
    peak = peak_flops(device)
    mfu = throughput / world_size * flops_per_token / peak if peak else 0.0
    return {
        "perf/throughput": throughput,
        "perf/throughput_per_gpu": throughput / world_size,
        "perf/mfu": mfu,
        "perf/peak_memory": peak_memory_gib(device),
        "time/step": step_time,
    }
