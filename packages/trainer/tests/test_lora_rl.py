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


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU")]),
    ],
)
def test_a_published_adapter_holds_its_parameters_at_that_step(tiny_model_dir, tmp_path, device):
    """The copy to the host is queued (on a GPU, a side stream: no sync on the loop) and written in the background:
    the file holds the adapter of the step it was published at, not of the in-place update queued after it."""
    from prime_rl.common.config.rl_trainer import FilesystemBroadcastConfig
    from prime_rl.common.config.trainer import LoRAConfig
    from prime_rl.common.rundir import RunDir
    from prime_rl.trainer.lora import apply_lora, init_lora_weights
    from prime_rl.trainer.model import CausalLM
    from prime_rl.trainer.models import build_model, load_hf_weights
    from prime_rl.trainer.rl.publish_lora import LoRAPublisher
    from prime_rl.trainer.world import World

    device = torch.device(device)
    model = build_model(str(tiny_model_dir), attn="sdpa", dtype=torch.float32, device=device)
    load_hf_weights(model, tiny_model_dir)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    init_lora_weights(model, seed=0)
    lora_b = dict((n, p) for n, p in model.named_parameters() if n.endswith("lora_B"))
    with torch.no_grad():
        for p in lora_b.values():
            p.normal_()
    world = World(rank=0, local_rank=0, world_size=1, device=device)
    run_dir = RunDir(tmp_path, "gpu")
    publisher = LoRAPublisher(FilesystemBroadcastConfig(dtype="float32"), run_dir, CausalLM(model, None), world, "gpu")
    expected = {n: p.detach().cpu().clone() for n, p in lora_b.items()}
    publisher.publish(1)
    with torch.no_grad():  # the next optimizer step, queued right after the publish
        for p in lora_b.values():
            p.add_(1.0)
    publisher.close()
    with safe_open(str(run_dir.broadcast_dir(1) / "adapter_model.safetensors"), framework="pt") as f:
        written = {k: f.get_tensor(k) for k in f.keys() if k.endswith("lora_B.weight")}
    assert len(written) == len(expected) > 0
    assert sorted(written) == sorted(f"base_model.model.model.{name}.weight" for name in expected)
    for name, value in expected.items():
        assert torch.equal(written[f"base_model.model.model.{name}.weight"], value), name
