"""Pruning trainer checkpoints (`ckpt.keep_last`) keeps what each component needs to resume.

Trainer and orchestrator write into the same `checkpoints/step_<n>/` (`trainer/`, `orchestrator/`).
The trainer keeps its newest `keep_last`; the orchestrator keeps every step. A run pruned down to its
last trainer checkpoint must resume both from that step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prime_rl.common.config.orchestrator import OrchestratorConfig
from prime_rl.common.rundir import RunDir
from prime_rl.common.testing import make_tiny_model
from prime_rl.orchestrator.envs.reverse_text import ReverseTextEnv
from prime_rl.orchestrator.orchestrator import Orchestrator
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
    assert run_dir.resolve_resume_step("latest", components=("orchestrator",)) == 3
    config = OrchestratorConfig(output_dir=tmp_path, run_name="run", ckpt={"resume_step": 3})
    orchestrator = Orchestrator(config, ReverseTextEnv(), None, NoInferenceControl(), lambda batches: None)
    assert orchestrator.step == 3 and orchestrator.scheduler.tasks_drawn == 6
    # pruning went on after the resume and still spared the orchestrator; step 3 stays whole: it is the
    # newest step complete for both (the orchestrator did not save step 4 here), the only one to resume from
    assert (run_dir.trainer_checkpoint_dir(3) / ".done").exists() and (
        run_dir.trainer_checkpoint_dir(4) / ".done"
    ).exists()
    assert run_dir.latest_complete_checkpoint() == 3
    assert all((run_dir.orchestrator_checkpoint_dir(s) / "state.json").is_file() for s in (1, 2, 3))


def test_pruning_removes_step_dirs_nobody_else_uses(tmp_path):
    from prime_rl.trainer.ckpt import DONE, CheckpointManager

    run_dir = RunDir(tmp_path, "run")
    for step in (1, 2, 3):
        run_dir.trainer_checkpoint_dir(step).mkdir(parents=True)
        (run_dir.trainer_checkpoint_dir(step) / DONE).touch()
    for step in (2, 3):
        save_state(
            OrchestratorState.capture(step, 4, np.random.default_rng(0), 0), run_dir.orchestrator_checkpoint_dir(step)
        )
    CheckpointManager(run_dir, keep_last=1, is_main=True)._prune()
    assert run_dir.checkpoint_steps() == [2, 3]  # step_1 had only the trainer's part
    assert sorted(p.name for p in run_dir.checkpoint_dir(2).iterdir()) == ["orchestrator"]


@pytest.mark.chaos
def test_pruning_keeps_the_newest_step_complete_for_every_component(tmp_path):
    """Probe: keep_last=1 pruned the trainer's step 4 once it saved step 8, but the orchestrator (killed)
    had saved only step 4: no step was left to resume from."""
    from prime_rl.trainer.ckpt import DONE, CheckpointManager

    run_dir = RunDir(tmp_path, "run")
    for step in (2, 4, 8):
        run_dir.trainer_checkpoint_dir(step).mkdir(parents=True)
        (run_dir.trainer_checkpoint_dir(step) / DONE).touch()
    for step in (2, 4):
        save_state(
            OrchestratorState.capture(step, 0, np.random.default_rng(0), 0), run_dir.orchestrator_checkpoint_dir(step)
        )
    CheckpointManager(run_dir, keep_last=1, is_main=True)._prune()
    assert not (run_dir.trainer_checkpoint_dir(2)).exists()
    assert run_dir.complete_checkpoint_steps() == [4]  # still resumable
    save_state(OrchestratorState.capture(8, 0, np.random.default_rng(0), 0), run_dir.orchestrator_checkpoint_dir(8))
    CheckpointManager(run_dir, keep_last=1, is_main=True)._prune()
    assert run_dir.complete_checkpoint_steps() == [8]  # now step 4's trainer part may go


def _dcp_save_world_1(path_setup, tmp_path):
    import torch
    import torch.distributed as dist

    from prime_rl.trainer.ckpt import CheckpointManager

    run_dir = RunDir(tmp_path, "run")
    path_setup(run_dir)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(64, 64)
        optimizer = torch.optim.AdamW(model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        return CheckpointManager(run_dir, keep_last=None, is_main=True).save(5, model, optimizer, scheduler)
    finally:
        dist.destroy_process_group()


@pytest.mark.chaos
def test_disk_full_names_itself(tmp_path):
    """ENOSPC from the kernel (writes through a symlink to /dev/full) becomes one named error."""
    from prime_rl.common.diskfull import DiskFullError

    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (Linux)")
    run_dir = RunDir(tmp_path, "run")
    state_dir = run_dir.orchestrator_checkpoint_dir(3)
    state_dir.mkdir(parents=True)
    os.symlink("/dev/full", state_dir / "state.json.tmp")
    with pytest.raises(
        DiskFullError, match=r"disk full while writing the orchestrator state of step 3 to .*state.json \(.* free of"
    ):
        save_state(OrchestratorState.capture(3, 0, np.random.default_rng(0), 0), state_dir)
    assert not (state_dir / "state.json").exists()  # no commit marker for a part that was not written

    def full_shard(run: RunDir) -> None:
        run.trainer_checkpoint_dir(5).mkdir(parents=True)
        os.symlink("/dev/full", run.trainer_checkpoint_dir(5) / "__0_0.distcp")

    with pytest.raises(DiskFullError, match="trainer checkpoint of step 5 .* lower ckpt.keep_last"):
        _dcp_save_world_1(full_shard, tmp_path / "t")
    assert not (RunDir(tmp_path / "t", "run").trainer_checkpoint_dir(5) / ".done").exists()


@pytest.mark.chaos
def test_a_trainer_started_alone_resumes_where_the_orchestrator_can(tmp_path):
    """Probe: "latest" resolved by each component on its own resumed them at steps 8 and 4."""
    from prime_rl.trainer.ckpt import DONE

    run_dir = RunDir(tmp_path, "run")
    for step in (4, 8):
        run_dir.trainer_checkpoint_dir(step).mkdir(parents=True)
        (run_dir.trainer_checkpoint_dir(step) / DONE).touch()
    save_state(OrchestratorState.capture(4, 0, np.random.default_rng(0), 0), run_dir.orchestrator_checkpoint_dir(4))
    # the trainer resumes with the components the run dir shows (trainer/loop.py resume)
    assert run_dir.checkpoint_components() == ("trainer", "orchestrator")
    assert run_dir.resolve_resume_step("latest", run_dir.checkpoint_components()) == 4  # step 8: no orchestrator part
    with pytest.raises(FileNotFoundError, match="complete steps: \\[4\\]"):
        run_dir.resolve_resume_step(8, run_dir.checkpoint_components())
    sft = RunDir(tmp_path, "sft")  # no orchestrator anywhere: the trainer's own checkpoints count
    sft.trainer_checkpoint_dir(8).mkdir(parents=True)
    (sft.trainer_checkpoint_dir(8) / DONE).touch()
    assert sft.checkpoint_components() == ("trainer",)
    assert sft.resolve_resume_step("latest", sft.checkpoint_components()) == 8
