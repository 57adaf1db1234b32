import json
from pathlib import Path

from prime_rl.launcher.dashboard.metrics_tail import MetricsTail, parse_metrics_line


def write(path: Path, text: str, mode: str = "a") -> None:
    with open(path, mode) as f:
        f.write(text)


def test_missing_file_is_empty_not_an_error(tmp_path: Path) -> None:
    tail = MetricsTail(tmp_path / "metrics.jsonl")
    assert tail.poll() == 0
    assert tail.rows == [] and tail.skipped_lines == 0 and not tail.partial_line


def test_reads_only_appended_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    write(path, json.dumps({"step": 1, "loss/mean": 2.0}) + "\n")
    tail = MetricsTail(path)
    assert tail.poll() == 1
    first_offset = tail.offset
    assert tail.poll() == 0  # nothing new
    write(path, json.dumps({"step": 2, "loss/mean": 1.5, "perf/mfu": 0.3}) + "\n")
    assert tail.poll() == 1
    assert tail.offset > first_offset
    assert [r["step"] for r in tail.rows] == [1, 2]
    assert tail.keys == {"loss/mean", "perf/mfu"}
    assert tail.latest == {"step": 2, "loss/mean": 1.5, "perf/mfu": 0.3}


def test_partial_last_line_waits_until_complete(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    write(path, json.dumps({"step": 1, "x": 1}) + "\n" + '{"step": 2, "x"')
    tail = MetricsTail(path)
    assert tail.poll() == 1
    assert tail.partial_line and tail.skipped_lines == 0
    write(path, ": 2}\n")
    assert tail.poll() == 1
    assert not tail.partial_line
    assert tail.rows[-1] == {"step": 2, "x": 2.0}


def test_malformed_lines_are_counted_and_skipped(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [
        '{"step": 1, "x": 1}',
        "{not json",
        "[1, 2]",  # not an object
        '{"x": 3}',  # no step
        '{"step": "7", "x": 3}',  # step not an int
        '{"step": true}',
        "",  # blank lines are not errors
        b"\xff\xfe".decode("latin-1"),  # not UTF-8 JSON
        '{"step": 2, "x": NaN, "y": "text", "z": {"a": 1}, "flag": true}',
    ]
    write(path, "\n".join(lines) + "\n")
    tail = MetricsTail(path)
    assert tail.poll() == 2
    assert tail.skipped_lines == 6
    # NaN, strings and bools are dropped; nested dicts flatten to slash keys.
    assert tail.rows[1] == {"step": 2, "z/a": 1.0}
    assert tail.nonfinite == {"x": 2}  # ...but a NaN is remembered, not silently lost


def test_truncated_file_is_reread_with_new_epoch(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    write(path, "".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(1, 4)))
    tail = MetricsTail(path)
    tail.poll()
    write(path, json.dumps({"step": 1, "x": 9}) + "\n", mode="w")
    assert tail.poll() == 1
    assert tail.epoch == 1
    assert tail.rows == [{"step": 1, "x": 9.0}]


def test_parse_metrics_line_accepts_flat_writer_output() -> None:
    assert parse_metrics_line(b'{"step": 3, "reward/mean": 0.5, "time/step": 1}') == {
        "step": 3,
        "reward/mean": 0.5,
        "time/step": 1.0,
    }


def test_reads_what_the_common_file_monitor_writes(tmp_path: Path) -> None:
    from prime_rl.common.monitor import FileMonitor

    path = tmp_path / "monitors" / "file" / "metrics.jsonl"
    tail = MetricsTail(path)
    with FileMonitor(path) as monitor:
        monitor.log(1, {"loss/mean": 0.5, "perf/throughput": 1000})
        assert tail.poll() == 1
        monitor.log(2, {"loss/mean": float("nan"), "perf/throughput": 1100})
        assert tail.poll() == 1
    assert tail.rows == [
        {"step": 1, "loss/mean": 0.5, "perf/throughput": 1000.0},
        {"step": 2, "perf/throughput": 1100.0},
    ]
    assert tail.nonfinite == {"loss/mean": 2} and tail.skipped_lines == 0
