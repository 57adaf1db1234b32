"""The `sft` command end to end on CPU: config errors, dry run, the example learning on 2 gloo
processes (logs, metrics, checkpoints, HF export) and resume continuing the same loss curve."""

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from prime_rl.trainer.sft.entrypoint import main

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "sft"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "monitors/file/metrics.jsonl").read_text().splitlines()]


def test_bad_config_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model.name", "x", "--data.type", "fake", "--data.min-sample-len", "9999"])
    assert e.value.code == 2
    assert "min_sample_len" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--model.name", "x", "--data.type", "fake", "--optim.type", "sgd"])
    assert e.value.code == 2


def test_missing_model_dir_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model.name", str(tmp_path / "nope"), "--data.type", "fake", "--output-dir", str(tmp_path)])
    assert e.value.code == 2
    assert "no config.json" in capsys.readouterr().err


def test_dry_run_writes_resolved_config(tmp_path):
    main(["--model.name", "m", "--data.type", "fake", "--optim.type", "sign_sgd", "--max-steps", "4",
          "--output-dir", str(tmp_path), "--run-name", "r", "--dry-run"])  # fmt: skip
    cfg = tomllib.loads((tmp_path / "r/configs/trainer.toml").read_text())
    assert cfg["optim"]["type"] == "sign_sgd" and cfg["max_steps"] == 4 and cfg["data"]["type"] == "fake"
    assert not (tmp_path / "r/logs").exists()  # nothing launched


def test_example_learns_on_two_processes(tmp_path):
    subprocess.run([sys.executable, str(EXAMPLE / "make_example.py"), "--out", str(tmp_path)], check=True, env=ENV)
    cmd = [sys.executable, "-m", "prime_rl.trainer.sft.entrypoint", "@", str(EXAMPLE / "sft.toml"),
           "--model.name", str(tmp_path / "model"), "--data.path", str(tmp_path / "data.jsonl"),
           "--output-dir", str(tmp_path), "--max-steps", "12", "--ckpt.interval", "6",
           "--deployment.num-gpus", "2"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "run"
    console = proc.stdout + proc.stderr
    assert "Throughput" in console and "MFU" in console and "Peak Mem." in console
    assert "rank=0" in console and "rank=1" not in console  # console: rank 0 only
    logs = run / "logs/latest/trainer/torchrun"
    assert "rank=1] Step 12" in (logs / "1.log").read_text()
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, 13))
    for key in ("perf/throughput", "perf/mfu", "time/step", "perf/peak_memory", "loss/mean"):
        assert key in metrics[-1]
    assert metrics[-1]["loss/mean"] < 0.5 * metrics[0]["loss/mean"], [m["loss/mean"] for m in metrics]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_12"]  # keep_last = 1
    assert (run / "weights/step_12/model.safetensors").is_file()
    assert (run / "weights/step_12/tokenizer_config.json").is_file()


def _train(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "prime_rl.trainer.sft.train", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_resume_continues_the_same_loss_curve(tiny_model_dir, tmp_path):
    common = ["--model.name", str(tiny_model_dir), "--data.type", "fake", "--data.seq-len", "64",
              "--data.batch-size", "2", "--optim.lr", "1e-3", "--max-steps", "4", "--output-dir", str(tmp_path),
              "--ckpt.interval", "2", "--no-ckpt.export-hf"]  # fmt: skip
    _train([*common, "--run-name", "full"])
    full = _metrics(tmp_path / "full")
    # a second run that stopped after the step-2 checkpoint, then resumes from it
    shutil.copytree(tmp_path / "full/checkpoints/step_2", tmp_path / "resumed/checkpoints/step_2")
    _train([*common, "--run-name", "resumed", "--ckpt.resume-step", "latest"])
    resumed = _metrics(tmp_path / "resumed")
    assert [m["step"] for m in resumed] == [3, 4]
    for a, b in zip(full[2:], resumed):
        assert b["loss/mean"] == pytest.approx(a["loss/mean"], abs=1e-6)
