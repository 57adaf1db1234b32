"""Optimizer-state offload on a GPU: the streamed copies (prefetch during the last backward, offload after
the step) must not change a single number of the training run, and must keep the state off the device
during forward/backward. Run on the device machine: `pytest -m gpu packages/trainer/tests/test_offload_gpu.py`."""

import json
import subprocess
import sys

import pytest
import torch

from prime_rl.common.testing import make_tiny_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path = tmp_path_factory.mktemp("model") / "tiny"
    # wide enough that the AdamW state (8 bytes/param, ~0.25 GiB) dominates a 64-token step's activations
    make_tiny_model(path, kind="qwen3", dtype="float32", hidden_size=1024, num_layers=4, intermediate_size=4096)
    return path


def _sft(model_dir, out, offload: str) -> list[dict]:
    cmd = [sys.executable, "-m", "prime_rl.trainer.sft.entrypoint", "--model.name", str(model_dir),
           "--data.type", "fake", "--data.seq-len", "64", "--data.batch-size", "4", "--data.micro-batch-size", "1",
           "--max-steps", "5", "--model.offload", offload, "--model.ac", "None", "--model.ac-offloading", "None",
           "--optim.lr", "1e-3", "--no-ckpt.export-hf", "--output-dir", str(out), "--run-name", offload]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / offload / "monitors/file/metrics.jsonl").read_text().splitlines()]


def test_offload_matches_no_offload(model_dir, tmp_path):
    ref = _sft(model_dir, tmp_path, "none")
    ref2 = _sft(model_dir, tmp_path / "again", "none")
    off = _sft(model_dir, tmp_path, "optimizer")
    losses = {name: [r["loss/mean"] for r in rows] for name, rows in (("ref", ref), ("ref2", ref2), ("off", off))}
    # 4 micro-batches per step: the prefetch rides on the 4th backward; 5 steps: the state goes out and
    # comes back 4 times. A race or a stale buffer changes the loss from step 2 on by far more than the
    # run-to-run noise of the GPU kernels (measured here as ref vs ref2; zero when they are deterministic).
    noise = max(abs(a - b) for a, b in zip(losses["ref"], losses["ref2"], strict=True))
    diff = max(abs(a - b) for a, b in zip(losses["ref"], losses["off"], strict=True))
    assert diff <= max(2 * noise, 1e-6), losses
    # the state is off the device between steps and during forward: memory resident at the start of a
    # step drops by the whole state (8 bytes/param); the peak, here at the optimizer step (64-token rows
    # have almost no activations), is no higher than without offload
    state_gib = 8 * _num_params(model_dir) / 2**30
    resident_ref = max(r["perf/resident_memory"] for r in ref[1:])
    resident_off = max(r["perf/resident_memory"] for r in off[1:])
    assert resident_ref - resident_off > 0.95 * state_gib, (resident_ref, resident_off, state_gib)
    assert max(r["perf/peak_memory"] for r in off) <= max(r["perf/peak_memory"] for r in ref) + 0.01


def _num_params(model_dir) -> int:
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                n = 1
                for d in st.get_slice(key).get_shape():
                    n *= d
                total += n
    return total
