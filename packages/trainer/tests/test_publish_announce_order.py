"""The filesystem publisher announces a version before it prunes old ones: pruning (0.22-0.26 s for a
Qwen3-1.7B version on the H200 machine) is off the update's critical path, and never removes the
version it just announced."""

from types import SimpleNamespace

from prime_rl.common.rundir import BROADCAST_MARKER, RunDir
from prime_rl.trainer.rl import publish
from prime_rl.trainer.rl.publish import FilesystemPublisher


class _Announcer:
    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self.seen: list[tuple[int, str, list[int]]] = []

    def announce(self, version: int, path: str | None = None, publish_s: float = 0.0, write_s: float = 0.0) -> None:
        self.seen.append((version, path, self.run_dir.broadcast_steps()))  # what is on disk at the announcement


def test_the_announcement_comes_before_pruning_and_the_announced_version_is_kept(tmp_path, monkeypatch):
    run_dir = RunDir(tmp_path, "run")
    for step in (1, 2):
        run_dir.broadcast_dir(step).mkdir(parents=True)
        (run_dir.broadcast_dir(step) / BROADCAST_MARKER).touch()
    # the write itself is tested elsewhere (test_weight_files, tests/test_weight_publish): a marker-only version
    monkeypatch.setattr(publish, "load_arch_config", lambda config: config)
    monkeypatch.setattr(publish, "model_state_dict_to_hf", lambda tensors, config: tensors)
    monkeypatch.setattr(publish, "write_hf_dir", lambda tensors, out, config: out.mkdir(parents=True))
    publisher = object.__new__(FilesystemPublisher)  # no model or world: only _write's bookkeeping runs
    publisher.run_dir, publisher.model = run_dir, SimpleNamespace(config=None)
    publisher.cfg, publisher.last_write_time = SimpleNamespace(keep_last=1), 0.0
    publisher.announcer = _Announcer(run_dir)
    staging = SimpleNamespace(wait=lambda: None, tensors=lambda: {})

    publisher._write(3, staging, blocked=0.01)

    assert publisher.announcer.seen == [(3, str(run_dir.broadcast_dir(3)), [1, 2, 3])]  # nothing pruned yet
    assert run_dir.broadcast_steps() == [3]  # then keep_last=1 pruned the older ones, never the announced one
    assert publisher.last_write_time > 0
