import os

import pytest

from prime_rl.common.rundir import BROADCAST_MARKER, RunDir


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


def test_latest_published_step_needs_marker_and_bound(tmp_path):
    run = RunDir(tmp_path, "exp")
    assert run.latest_published_step() is None and run.broadcast_steps(published=True) == []  # no broadcasts/
    for step in (1, 2, 3):
        run.broadcast_dir(step).mkdir(parents=True)
        if step < 3:  # 3: not a complete version (never renamed into place by the trainer)
            (run.broadcast_dir(step) / BROADCAST_MARKER).touch()
    (run.broadcasts_dir / "step_4.tmp").mkdir()  # being written
    assert run.broadcast_steps() == [1, 2, 3] and run.broadcast_steps(published=True) == [1, 2]
    assert run.latest_published_step() == 2
    assert run.latest_published_step(max_step=1) == 1
    assert run.latest_published_step(max_step=0) is None


@pytest.mark.parametrize("name", ["", "a/b", ".."])
def test_bad_run_name(tmp_path, name):
    with pytest.raises(ValueError, match="run_name"):
        RunDir(tmp_path, name)


@pytest.mark.parametrize("step", [-1, 1.5, True])
def test_bad_step(tmp_path, step):
    with pytest.raises(ValueError, match="step"):
        RunDir(tmp_path, "exp").checkpoint_dir(step)


def _checkpoint(run: RunDir, step: int, parts: tuple[str, ...]) -> None:
    from prime_rl.common.rundir import CHECKPOINT_MARKERS

    for part in parts:
        d = run.checkpoint_dir(step) / part
        d.mkdir(parents=True, exist_ok=True)
        (d / CHECKPOINT_MARKERS[part]).write_text("{}")


@pytest.mark.chaos
def test_latest_is_the_newest_step_complete_for_every_component(tmp_path):
    """Probe: a kill between the orchestrator's and the trainer's checkpoint resumed them at 8 and 4."""
    run = RunDir(tmp_path, "r")
    _checkpoint(run, 4, ("trainer", "orchestrator"))
    _checkpoint(run, 8, ("orchestrator",))  # the trainer was killed while writing step 8
    (run.trainer_checkpoint_dir(8)).mkdir()  # ... without its marker
    assert run.complete_checkpoint_steps() == [4]
    assert run.resolve_resume_step("latest") == 4
    assert run.resolve_resume_step(None) is None
    assert run.resolve_resume_step("latest", components=("trainer",)) == 4  # sft: the trainer alone
    with pytest.raises(FileNotFoundError, match=r"step_8 is not complete .*'trainer': False.* complete steps: \[4\]"):
        run.resolve_resume_step(8)
    assert RunDir(tmp_path, "empty").resolve_resume_step("latest") is None
    assert run.checkpoint_components() == ("trainer", "orchestrator")  # an RL run: a trainer alone agrees
    assert RunDir(tmp_path, "empty").checkpoint_components() == ("trainer",)  # sft


@pytest.mark.chaos
def test_discard_after_sets_aside_everything_newer_than_the_resume_point(tmp_path):
    """Probe: the resumed orchestrator loaded the dead attempt's newer broadcasts/step_7."""
    run = RunDir(tmp_path, "r")
    run.start_attempt()
    for step in (2, 4, 6):
        _checkpoint(run, step, ("trainer", "orchestrator"))
    for step in range(1, 8):
        run.broadcast_dir(step).mkdir(parents=True)
    moved = run.discard_after(4)
    assert run.checkpoint_steps() == [2, 4] and run.broadcast_steps() == [1, 2, 3, 4]
    assert sorted(p.name for p in moved) == sorted(
        ["step_6.discarded-1", "step_5.discarded-1", "step_6.discarded-1", "step_7.discarded-1"]
    )
    assert (run.checkpoints_dir / "step_6.discarded-1" / "trainer" / ".done").is_file()  # set aside, not lost
    run.broadcast_dir(5).mkdir()
    assert run.discard_after(4)[0].name == "step_5.discarded-1.1"  # never overwrites an earlier discard
    run.discard_after(None)  # a fresh start keeps nothing a component could pick up
    assert run.checkpoint_steps() == [] and run.broadcast_steps() == []


@pytest.mark.chaos
def test_discard_after_drops_metrics_rows_past_the_resume_point(tmp_path):
    """Probe: after a resume at step 4, metrics.jsonl held step 5 twice (the dead attempt's and the new)."""
    import json

    from prime_rl.common.monitor import FileMonitor, read_metrics

    run = RunDir(tmp_path, "r")
    run.start_attempt()
    with FileMonitor(run) as monitor:
        for step in range(1, 6):
            monitor.log(step, {"reward/mean": step / 10})
        monitor.log(4, {"eval/pass@1": 0.5})  # an eval of step 4 that finished after step 5
    with open(run.metrics_path, "ab") as f:
        f.write(b'{"step":6,"reward/me')  # the writer was killed mid-line
    aside = run.discard_after(4)[-1]
    assert aside.name == "metrics.jsonl.discarded-1"
    assert [json.loads(line)["step"] for line in aside.read_text().splitlines()[:1]] == [5]
    with FileMonitor(run) as monitor:  # the resumed run logs step 5 again
        monitor.log(5, {"reward/mean": 0.55})
    rows = read_metrics(run.metrics_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 4, 5] and rows[-1]["reward/mean"] == 0.55
    assert run.discard_after(5) == []  # nothing past the resume point: the file is left alone
    run.discard_after(None)  # a fresh start keeps no rows
    assert read_metrics(run.metrics_path) == []
