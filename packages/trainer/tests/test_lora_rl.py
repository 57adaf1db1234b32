"""The RL trainer with `[model.lora]` on CPU (fake data, no inference): each step publishes the adapter alone in
peft format under broadcasts/step_<n>/, and bad LoRA input exits 2 with one line before any step."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open


def _run_trainer(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "prime_rl.trainer.rl.train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


def _common(model_dir, tmp_path) -> list[str]:
    return ["--model.name", str(model_dir), "--output-dir", str(tmp_path), "--run-name", "lora",
            "--data.fake", "--data.fake.generate-samples", "--data.fake.doc-len", "40", "--data.seq-len", "128",
            "--data.fake.batch-size", "2", "--max-steps", "2", "--model.lora.rank", "4",
            "--model.lora.target-modules", '["q_proj", "v_proj"]']  # fmt: skip


def test_each_step_publishes_only_the_adapter(tiny_model_dir, tmp_path):
    out = _run_trainer(_common(tiny_model_dir, tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "LoRA rank 4, alpha 32 on 4 layers" in out.stdout + out.stderr
    published = tmp_path / "lora/broadcasts/step_2"
    assert sorted(p.name for p in published.iterdir()) == [
        "STABLE", "adapter_config.json", "adapter_model.safetensors", "prime_rl_adapter.json",
    ]  # fmt: skip
    assert json.loads((published / "prime_rl_adapter.json").read_text()) == {"name": "lora", "version": 2}
    assert json.loads((published / "adapter_config.json").read_text())["target_modules"] == ["q_proj", "v_proj"]
    with safe_open(str(published / "adapter_model.safetensors"), framework="pt") as f:
        keys = sorted(f.keys())
        b = f.get_tensor("base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight")
    assert len(keys) == 2 * 2 * 2 and b.abs().max() > 0  # 2 layers x (q, v) x (A, B); B moved off zero
    rows = [json.loads(line) for line in (tmp_path / "lora/monitors/file/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "time/publish_weights" in rows[-1]


def test_bad_lora_input_exits_2_with_one_line(tiny_model_dir, tmp_path):
    out = _run_trainer([*_common(tiny_model_dir, tmp_path), "--model.lora.rank", "4096"])
    assert out.returncode == 2
    errors = [line for line in (out.stdout + out.stderr).splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "model.lora.rank=4096 exceeds" in errors[0], out.stdout + out.stderr


@pytest.mark.gpu
def test_adapter_tensors_reach_the_host_unchanged_through_one_flat_copy():
    from prime_rl.trainer.rl.publish_lora import to_host_flat

    tensors = {f"t{i}": torch.randn(3 + i, 5, device="cuda", dtype=torch.bfloat16) for i in range(4)}
    host = to_host_flat(tensors)
    assert list(host) == list(tensors)
    for name, t in tensors.items():
        assert host[name].device.type == "cpu" and torch.equal(host[name], t.cpu())
