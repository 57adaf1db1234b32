"""PRIME_RL_PROFILE_DIR: the real loop's profiled steps leave a trace, an op table and the device time per kernel."""

import json
from types import SimpleNamespace

import torch

from prime_rl.common.env import PROFILE_DIR_ENV, PROFILE_STEPS_ENV
from prime_rl.trainer.loop import StepProfiler, kernel_times


def test_profiled_steps_write_trace_ops_and_kernel_times(tmp_path, monkeypatch):
    out = tmp_path / "prof"
    monkeypatch.setenv(PROFILE_DIR_ENV, str(out))
    monkeypatch.setenv(PROFILE_STEPS_ENV, "2,3")
    profiler = StepProfiler(is_main=True)
    x = torch.randn(64, 64)
    for done in (1, 2, 3, 4):  # the loop's calls: before(step + 1) ... after(done)
        profiler.before(done)
        x = x @ x.T / 64
        profiler.after(done)
        if done < 3:
            assert not out.exists(), f"written after step {done}, before the last profiled step (3)"
    assert (out / "trace.json").is_file() and "aten::mm" in (out / "ops.txt").read_text()
    times = json.loads((out / "kernels.json").read_text())
    assert times["steps"] == 2 and times["wall_s"] > 0
    assert times["kernels"] == {}  # no device here: the CPU ops are in ops.txt


def test_only_the_main_rank_profiles(tmp_path, monkeypatch):
    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path / "prof"))
    profiler = StepProfiler(is_main=False)
    for done in range(1, 7):
        profiler.before(done)
        profiler.after(done)
    assert not (tmp_path / "prof").exists()


def _event(name: str, us: float, device: bool = True, annotation: bool = False) -> SimpleNamespace:
    kind = torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU
    return SimpleNamespace(
        name=name, device_type=kind, is_user_annotation=annotation, time_range=SimpleNamespace(elapsed_us=lambda: us)
    )


def test_kernel_times_sum_device_kernels_by_name_and_skip_annotations():
    prof = SimpleNamespace(
        events=lambda: [
            _event("nvjet_gemm", 100.0),
            _event("nvjet_gemm", 50.0),
            _event("ce_rows_kernel", 20.0),
            _event("FSDP::post_backward_reduce", 500.0, annotation=True),  # spans kernels counted already
            _event("aten::mm", 999.0, device=False),  # the host op that launched the gemm
        ]
    )
    times = kernel_times(prof, wall_s=0.5, steps=2)
    assert times == {
        "steps": 2,
        "wall_s": 0.5,
        "kernels": {"nvjet_gemm": {"us": 150.0, "calls": 2}, "ce_rows_kernel": {"us": 20.0, "calls": 1}},
    }
