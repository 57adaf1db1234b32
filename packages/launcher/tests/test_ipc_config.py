"""`[weight_broadcast] type = "ipc"` in `rl`: wired like the other push transports (control addresses, a
reserved channel port), refused in one line where trainer and inference cannot share memory."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from prime_rl.common.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", dtype="float32")


def _rl(model_dir, tmp_path, *flags):
    return subprocess.run(
        [sys.executable, "-m", "prime_rl.launcher.rl", "--model.name", str(model_dir), "--output-dir", str(tmp_path),
         "--weight-broadcast.type", "ipc", *flags, "--dry-run"],
        capture_output=True, text=True,
    )  # fmt: skip


def test_host_memory_is_wired_to_every_inference_server(model_dir, tmp_path):
    out = _rl(model_dir, tmp_path, "--weight-broadcast.memory", "host")
    assert out.returncode == 0, out.stderr
    configs = tmp_path / "rl" / "configs"
    wb = tomllib.loads((configs / "trainer.toml").read_text())["weight_broadcast"]
    assert wb["type"] == "ipc" and wb["memory"] == "host" and wb["bucket_bytes"] == 1 << 30
    # the trainer drives the load (the lifecycle table): it gets the control address of the one server
    assert len(wb["inference_addresses"]) == 1 and re.fullmatch(r"tcp://127\.0\.0\.1:\d+", wb["inference_addresses"][0])
    assert wb["port"] != 29720  # reserved for the run, as nccl's rendezvous port is


@pytest.mark.parametrize(
    "flags, message",
    [
        ([], "weight_broadcast.memory='device' reads the trainer's GPU, but deployment.num_infer_gpus=1"),
        (["--deployment.num-infer-gpus", "0"], "no GPU is visible"),  # this machine: trainer and vLLM on the CPU
        (["--weight-broadcast.memory", "host", "--slurm.job-name", "t"], "a SLURM job puts the trainer and inference"),
    ],
)
def test_device_memory_without_shared_gpus_and_slurm_are_one_line(model_dir, tmp_path, flags, message):
    out = _rl(model_dir, tmp_path, *flags)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert "memory='host'" in out.stderr or "nccl" in out.stderr  # the fix is named
