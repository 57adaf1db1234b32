"""Heartbeat files: what a process is doing and until when; the watchdog's input."""

import json
import time

from prime_rl.common.env import HEARTBEAT_DIR_ENV, STALL_TIMEOUT_ENV
from prime_rl.common.heartbeat import Heartbeat, last_line, read_beats


def test_a_beat_records_phase_step_and_deadline(tmp_path):
    hb = Heartbeat(tmp_path, "trainer", rank=1, default_deadline_s=30, log="/x.log")
    hb.beat("step", 3)
    (beat,) = read_beats(tmp_path)
    assert (beat.component, beat.rank, beat.phase, beat.step, beat.deadline_s, beat.log) == (
        "trainer", 1, "step", 3, 30, "/x.log"
    )  # fmt: skip
    assert -31 < beat.overdue_s() < -29
    assert beat.overdue_s(now=beat.since + 45) == 15


def test_the_deadline_restarts_only_with_progress(tmp_path):
    hb = Heartbeat(tmp_path, "orchestrator", min_interval_s=0.0)
    hb.beat("wait_weights", 5, deadline_s=10)
    since = read_beats(tmp_path)[0].since
    time.sleep(0.02)
    hb.beat("wait_weights", 5, deadline_s=10)  # still waiting: the clock keeps running
    assert read_beats(tmp_path)[0].since == since
    hb.beat("wait_weights", 5, deadline_s=10, progress=True)
    assert read_beats(tmp_path)[0].since > since
    hb.beat("rollouts", 6, deadline_s=10)
    assert read_beats(tmp_path)[0].phase == "rollouts"


def test_beats_are_rate_limited_unless_something_changes(tmp_path):
    hb = Heartbeat(tmp_path, "trainer", min_interval_s=60.0)
    hb.beat("step", 1)
    written = hb.path.read_text()
    hb.beat("step", 1)
    assert hb.path.read_text() == written
    hb.beat("step", 2)
    assert json.loads(hb.path.read_text())["step"] == 2


def test_from_env_is_a_no_op_outside_a_run(tmp_path, monkeypatch):
    monkeypatch.delenv(HEARTBEAT_DIR_ENV, raising=False)
    hb = Heartbeat.from_env("trainer")
    hb.beat("step", 1)
    assert not hb.enabled
    monkeypatch.setenv(HEARTBEAT_DIR_ENV, str(tmp_path / "hb"))
    monkeypatch.setenv(STALL_TIMEOUT_ENV, "12.5")
    hb = Heartbeat.from_env("trainer", 2)
    hb.beat("step", 1)
    assert read_beats(tmp_path / "hb")[0].deadline_s == 12.5


def test_old_and_unreadable_beats_are_skipped(tmp_path):
    Heartbeat(tmp_path, "a").beat("x")
    (tmp_path / "junk.json").write_text("{not json")
    assert len(read_beats(tmp_path)) == 1
    assert read_beats(tmp_path, newer_than=time.time() + 10) == []
    Heartbeat(tmp_path, "b").close()
    assert {b.component: b.overdue_s() < 0 for b in read_beats(tmp_path)} == {"a": True, "b": True}


def test_last_line(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("one\ntwo\n\n")
    assert last_line(log) == "two" and last_line(tmp_path / "missing") == ""
