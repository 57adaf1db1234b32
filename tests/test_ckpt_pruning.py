"""Pruning trainer checkpoints (`ckpt.keep_last`) keeps what each component needs to resume.

Trainer and orchestrator write into the same `checkpoints/step_<n>/` (`trainer/`, `orchestrator/`).
The trainer keeps its newest `keep_last`; the orchestrator keeps every step. A run pruned down to its
last trainer checkpoint must resume both from that step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prime_rl.common.config.orchestrator import OrchestratorConfig
from prime_rl.common.rundir import RunDir
from prime_rl.common.testing import make_tiny_model
from prime_rl.orchestrator.envs.reverse_text import ReverseTextEnv
from prime_rl.orchestrator.orchestrator import Orchestrator, resolve_resume_step
from prime_rl.orchestrator.state import OrchestratorState, save_state
from prime_rl.orchestrator.weights import NoInferenceControl

pytest.importorskip("torch")


def _train(model: Path, out: Path, *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "prime_rl.trainer.rl.train", "--model.name", str(model), "--output-dir", str(out),
           "--run-name", "run", "--data.fake", "--data.fake.generate-samples", "--data.fake.doc-len", "40",
           "--data.seq-len", "128", "--data.fake.batch-size", "2", "--weight-broadcast.dtype", "float32",
           "--ckpt.interval", "1", "--ckpt.keep-last", "1", *extra]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = (out / "run" / "monitors/file/metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_resume_after_pruning(tmp_path):
    model = make_tiny_model(tmp_path / "model", dtype="float32")
    run_dir = RunDir(tmp_path, "run")
    rng = np.random.default_rng(0)
    for step in (1, 2, 3):  # the orchestrator's state after each batch, as its own loop saves it
        rng.random(step)
        save_state(OrchestratorState.capture(step, 2 * step, rng, 0), run_dir.orchestrator_checkpoint_dir(step))

    rows = _train(model, tmp_path, "--max-steps", "3")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the trainer kept its last checkpoint only; every orchestrator state is still there
    for step in (1, 2, 3):
        assert (run_dir.trainer_checkpoint_dir(step) / ".done").exists() == (step == 3)
        assert (run_dir.orchestrator_checkpoint_dir(step) / "state.json").is_file()

    # both resume from step 3: the trainer continues with step 4, the orchestrator with batch 3
    rows = _train(model, tmp_path, "--max-steps", "4", "--ckpt.resume-step", "latest")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert resolve_resume_step(run_dir, "latest") == 3
    config = OrchestratorConfig(output_dir=tmp_path, run_name="run", ckpt={"resume_step": 3})
    orchestrator = Orchestrator(config, ReverseTextEnv(), None, NoInferenceControl(), lambda batches: None)
    assert orchestrator.step == 3 and orchestrator.scheduler.tasks_drawn == 6
    # pruning went on after the resume and still spared the orchestrator
    assert not run_dir.trainer_checkpoint_dir(3).exists() and (run_dir.trainer_checkpoint_dir(4) / ".done").exists()
    assert all((run_dir.orchestrator_checkpoint_dir(s) / "state.json").is_file() for s in (1, 2, 3))


def test_pruning_removes_step_dirs_nobody_else_uses(tmp_path):
    from prime_rl.trainer.ckpt import DONE, CheckpointManager

    run_dir = RunDir(tmp_path, "run")
    for step in (1, 2, 3):
        run_dir.trainer_checkpoint_dir(step).mkdir(parents=True)
        (run_dir.trainer_checkpoint_dir(step) / DONE).touch()
    save_state(OrchestratorState.capture(2, 4, np.random.default_rng(0), 0), run_dir.orchestrator_checkpoint_dir(2))
    CheckpointManager(run_dir, keep_last=1, is_main=True)._prune()
    assert run_dir.checkpoint_steps() == [2, 3]  # step_1 had only the trainer's part
    assert sorted(p.name for p in run_dir.checkpoint_dir(2).iterdir()) == ["orchestrator"]
