"""load_hf_weights / save_hf_weights on FSDP2-sharded (DTensor) parameters over 2 gloo CPU processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("sharded_weights_worker.py")


def test_load_and_save_sharded_parameters(hf_model_factory, tmp_path):
    _, src = hf_model_factory("qwen3_moe")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(WORKER), str(src), str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "rank0" / "model.safetensors").exists() and (tmp_path / "rank1" / "config.json").exists()
