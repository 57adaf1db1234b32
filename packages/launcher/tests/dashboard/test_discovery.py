from pathlib import Path

from prime_rl.launcher.dashboard.discovery import find_run_dirs, run_name

from .helpers import make_run


def test_finds_runs_at_any_depth_and_not_inside_runs(tmp_path: Path) -> None:
    a = make_run(tmp_path, "a", steps=1)
    b = make_run(tmp_path, "sweep/lr/1e-5/b", steps=1)
    # A folder that looks like a run inside a run's subtree (e.g. a copied checkpoint) is not walked into.
    (a / "checkpoints" / "step_1" / "monitors").mkdir(parents=True)
    (tmp_path / "sweep" / "notes").mkdir()
    (tmp_path / ".hidden" / "x" / "monitors").mkdir(parents=True)
    assert find_run_dirs(tmp_path) == [a, b]
    assert run_name(b, tmp_path) == "sweep/lr/1e-5/b"


def test_run_without_metrics_yet_is_found(tmp_path: Path) -> None:
    only_logs = tmp_path / "starting"
    (only_logs / "logs" / "latest").mkdir(parents=True)
    only_monitors = tmp_path / "empty"
    (only_monitors / "monitors").mkdir(parents=True)
    assert find_run_dirs(tmp_path) == [only_monitors, only_logs]


def test_root_itself_can_be_a_run_and_missing_root_is_empty(tmp_path: Path) -> None:
    run = make_run(tmp_path, "r", steps=1)
    assert find_run_dirs(run) == [run]
    assert run_name(run, run) == "r"
    assert find_run_dirs(tmp_path / "nope") == []


def test_symlink_loop_does_not_hang(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "loop").symlink_to(tmp_path)
    run = make_run(tmp_path, "d/run", steps=1)
    assert find_run_dirs(tmp_path) == [run]
