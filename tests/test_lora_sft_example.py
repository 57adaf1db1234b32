"""`sft` with `[model.lora]` end to end on CPU: the LoRA example learns, checkpoints adapters only, exports the
peft adapter and merged weights, and a resumed run continues the same loss curve. Cross-package: the example's
data is built by the orchestrator's arithmetic environment (examples/arithmetic/make_example.py)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "monitors/file/metrics.jsonl").read_text().splitlines()]


def _sft(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "prime_rl.trainer.sft.entrypoint", "@", str(ROOT / "examples/lora/sft.toml"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_lora_example_learns_exports_and_resumes(tmp_path):
    make = ROOT / "examples/arithmetic/make_example.py"
    subprocess.run([sys.executable, str(make), "--out", str(tmp_path), "--num-samples", "400"], check=True, env=ENV)
    common = ["--model.name", str(tmp_path / "model"), "--data.path", str(tmp_path / "sft.jsonl"),
              "--output-dir", str(tmp_path), "--max-steps", "12", "--ckpt.interval", "6"]  # fmt: skip
    _sft([*common, "--run-name", "full"])
    run = tmp_path / "full"
    metrics = _metrics(run)
    assert metrics[-1]["loss/mean"] < 0.5 * metrics[0]["loss/mean"], [m["loss/mean"] for m in metrics]
    adapter = run / "weights/step_12"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 16 and config["modules_to_save"] == ["embed_tokens", "lm_head"]
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "merged/model.safetensors").is_file()
    ckpt_bytes = sum(f.stat().st_size for f in (run / "checkpoints/step_6").rglob("*") if f.is_file())
    assert ckpt_bytes < 3.5e6  # adapters + embeddings / LM head + AdamW state, not the frozen layers' state

    shutil.copytree(run / "checkpoints/step_6", tmp_path / "resumed/checkpoints/step_6")
    _sft([*common, "--run-name", "resumed", "--ckpt.resume-step", "latest", "--no-ckpt.export-hf"])
    resumed = _metrics(tmp_path / "resumed")
    assert [m["step"] for m in resumed] == list(range(7, 13))
    for a, b in zip(metrics[6:], resumed):
        assert b["loss/mean"] == pytest.approx(a["loss/mean"], abs=1e-6)
