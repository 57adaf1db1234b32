import os

import pytest

from prime_rl.common.rundir import RunDir


def test_layout_matches_design(tmp_path):
    run = RunDir(tmp_path, "exp")
    assert run.root == tmp_path / "exp"
    assert run.config_path("trainer") == run.root / "configs" / "trainer.toml"
    assert run.metrics_path == run.root / "monitors" / "file" / "metrics.jsonl"
    assert run.trainer_checkpoint_dir(7) == run.root / "checkpoints" / "step_7" / "trainer"
    assert run.orchestrator_checkpoint_dir(7) == run.root / "checkpoints" / "step_7" / "orchestrator"
    assert run.broadcast_dir(3) == run.root / "broadcasts" / "step_3"
    assert run.launcher_dir == run.root / "launcher"
    assert not run.root.exists()  # computing paths creates nothing


def test_each_launch_gets_a_new_attempt_and_latest_follows(tmp_path):
    run = RunDir(tmp_path, "exp")
    with pytest.raises(FileNotFoundError, match="start_attempt"):
        _ = run.attempt
    assert run.start_attempt() == 1
    assert run.log_path("orchestrator") == run.root / "logs" / "attempt_1" / "orchestrator.log"
    assert run.start_attempt() == 2
    assert run.attempt == 2 and run.attempts() == [1, 2]
    assert os.readlink(run.latest_logs) == "attempt_2"  # relative, so the run dir can move
    assert run.trainer_log_path(3) == run.root / "logs" / "attempt_2" / "trainer" / "torchrun" / "3.log"
    assert run.log_path("inference", attempt=1) == run.root / "logs" / "attempt_1" / "inference.log"
    run.trainer_log_dir().mkdir(parents=True)
    assert (run.latest_logs / "trainer" / "torchrun").is_dir()
    # a second RunDir object (another process) sees the same attempt
    assert RunDir(tmp_path, "exp").attempt == 2


def test_step_listings(tmp_path):
    run = RunDir(tmp_path, "exp").ensure()
    for step in (10, 2):
        run.trainer_checkpoint_dir(step).mkdir(parents=True)
        run.broadcast_dir(step).mkdir(parents=True)
    (run.checkpoints_dir / "step_x").mkdir()
    (run.checkpoints_dir / "notes.txt").write_text("not a step")
    assert run.checkpoint_steps() == [2, 10]
    assert run.broadcast_steps() == [2, 10]
    assert run.configs_dir.is_dir() and run.metrics_path.parent.is_dir()


@pytest.mark.parametrize("name", ["", "a/b", ".."])
def test_bad_run_name(tmp_path, name):
    with pytest.raises(ValueError, match="run_name"):
        RunDir(tmp_path, name)


@pytest.mark.parametrize("step", [-1, 1.5, True])
def test_bad_step(tmp_path, step):
    with pytest.raises(ValueError, match="step"):
        RunDir(tmp_path, "exp").checkpoint_dir(step)
