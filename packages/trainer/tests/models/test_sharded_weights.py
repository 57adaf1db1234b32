"""load_hf_weights / save_hf_weights on FSDP2-sharded (DTensor) parameters over 2 gloo CPU processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from prime_rl.trainer.testing import torchrun

pytestmark = pytest.mark.multiprocess  # several processes: the dev-venv suite runs them

WORKER = Path(__file__).with_name("sharded_weights_worker.py")


def test_load_and_save_sharded_parameters(hf_model_factory, tmp_path):
    _, src = hf_model_factory("qwen3_moe")
    torchrun(str(WORKER), str(src), str(tmp_path), nproc=2)
    assert (tmp_path / "rank0" / "model.safetensors").exists() and (tmp_path / "rank1" / "config.json").exists()
