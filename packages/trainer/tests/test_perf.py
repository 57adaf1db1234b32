import torch

from prime_rl.trainer.perf import PEAK_BF16_FLOPS, peak_flops, perf_metrics


def test_cpu_reports_zero_mfu_and_positive_memory():
    m = perf_metrics(num_tokens=1000, step_time=0.5, world_size=2, flops_per_token=1e9, device=torch.device("cpu"))
    assert peak_flops(torch.device("cpu")) is None
    assert m["perf/mfu"] == 0.0
    assert m["perf/throughput"] == 2000 and m["perf/throughput_per_gpu"] == 1000
    assert m["perf/peak_memory"] > 0


def test_h200_peak():
    assert PEAK_BF16_FLOPS["H200"] == 989e12
