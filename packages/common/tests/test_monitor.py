import json
import math

import numpy as np
import pytest

from prime_rl.common.monitor import FileMonitor, read_metrics, scan_metrics
from prime_rl.common.rundir import RunDir


def test_one_line_per_step_readable_while_open(tmp_path):
    run = RunDir(tmp_path, "exp")
    monitor = FileMonitor(run)
    monitor.log(1, {"loss/mean": 0.5, "perf/throughput": np.float32(1000.0), "reward/mean": np.float64(0.25)})
    # no close/flush: the line is already in the file
    assert run.metrics_path.read_text().endswith("\n")
    monitor.log(2, {"loss/mean": float("nan"), "time/step": 3})
    records = read_metrics(run.metrics_path)
    monitor.close()
    assert records[0] == {"step": 1, "loss/mean": 0.5, "perf/throughput": 1000.0, "reward/mean": 0.25}
    assert records[1]["step"] == 2 and math.isnan(records[1]["loss/mean"])
    assert list(records[0])[0] == "step"


def test_target_forms(tmp_path):
    FileMonitor(tmp_path / "a.jsonl").log(0, {})
    FileMonitor(tmp_path / "run").log(0, {})  # a run root
    assert (tmp_path / "a.jsonl").exists()
    assert RunDir(tmp_path, "run").metrics_path.exists()


def test_appends_across_monitors(tmp_path):
    path = tmp_path / "m.jsonl"
    with FileMonitor(path) as monitor:
        monitor.log(1, {"a": 1})
    with FileMonitor(path) as monitor:
        monitor.log(2, {"a": 2})
    assert [r["step"] for r in read_metrics(path)] == [1, 2]


def test_bad_metrics_are_refused(tmp_path):
    with FileMonitor(tmp_path / "m.jsonl") as monitor:
        with pytest.raises(ValueError, match="'step'"):
            monitor.log(1, {"step": 2})
        with pytest.raises(TypeError, match="not JSON-serializable"):
            monitor.log(1, {"a": object()})
    assert (tmp_path / "m.jsonl").read_text() == ""  # nothing half-written


def test_reader_skips_partial_tail_and_reports_malformed_lines(tmp_path, caplog):
    path = tmp_path / "m.jsonl"
    lines = [
        json.dumps({"step": 1, "a": 1.0}),
        "{not json",
        json.dumps([1, 2]),
        json.dumps({"a": 3}),
        "",
        json.dumps({"step": 2, "a": 2.0}),
    ]
    path.write_text("\n".join(lines) + "\n" + '{"step": 3, "a"')
    with caplog.at_level("WARNING"):
        records = read_metrics(path)
    assert records == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}]
    scan = scan_metrics(path)
    assert [(s.line_number, s.reason.split(" ")[0]) for s in scan.skipped] == [(2, "not"), (3, "not"), (4, "no")]
    assert scan.partial_tail == '{"step": 3, "a"'
    assert "m.jsonl:2 skipped" in caplog.text and "m.jsonl:4 skipped" in caplog.text
    assert 'step": 3' not in caplog.text  # the in-progress line is not an error
