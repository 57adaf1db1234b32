"""`[monitor.wandb]`, offline (`mode = "offline"`): metrics, the run's config and sample tables reach the
local W&B run files, metrics.jsonl is still written, and wandb is never imported unless configured."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time

import pytest

from prime_rl.common.config import load_config
from prime_rl.common.config.base import BaseConfig
from prime_rl.common.config.monitor import MonitorConfig
from prime_rl.common.monitor import build_monitor, read_metrics
from prime_rl.common.rundir import RunDir


class Run(BaseConfig):
    monitor: MonitorConfig = MonitorConfig()
    lr: float = 1e-5


def test_wandb_is_not_imported_unless_configured(tmp_path):
    code = (
        "import sys\nfrom prime_rl.common.monitor import build_monitor\nfrom prime_rl.common.rundir import RunDir\n"
        f"m = build_monitor(RunDir({str(tmp_path)!r}, 'r'), None, 'trainer')\nm.log(1, {{'loss': 1.0}})\n"
        "m.close()\nassert 'wandb' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _records(run_dir) -> list:
    """The protobuf records of an offline run's .wandb file (a LevelDB-style log: 7-byte file header,
    32 KiB blocks of records with a 7-byte header each; wandb no longer ships a Python reader)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    out, pos, parts = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):  # block padding
            pos += left
            continue
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            out.append(record)
            parts = b""
    return out


def _history(records) -> list[dict]:
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]


def test_offline_run_gets_metrics_config_and_sample_tables(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(Run, ["--monitor.wandb.mode", "offline", "--monitor.wandb.max-samples", "2", "--lr", "3e-4"])
    run_dir = RunDir(tmp_path, "exp1")
    monitor = build_monitor(run_dir, cfg.monitor, "orchestrator", run_config=cfg.model_dump(mode="json"))
    monitor.log(1, {"reward/mean": 0.25, "loss/mean": 2.0})
    monitor.log_samples(1, [{"prompt": "1+2", "completion": "3", "reward": 1.0}] * 3)
    monitor.log(2, {"reward/mean": 0.5, "loss/mean": 1.5})
    monitor.close()

    assert [r["reward/mean"] for r in read_metrics(run_dir.metrics_path)] == [0.25, 0.5]  # still written
    wandb_dir = tmp_path / "exp1" / "monitors" / "wandb"
    deadline = time.monotonic() + 30  # wandb's service process may still be flushing the file after finish()
    records = _records(wandb_dir)
    while "exit" not in [r.WhichOneof("record_type") for r in records]:
        assert time.monotonic() < deadline, [r.WhichOneof("record_type") for r in records]
        time.sleep(0.2)
        records = _records(wandb_dir)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.display_name, run.run_group, run.job_type) == ("exp1-orchestrator", "exp1", "orchestrator")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["lr"] == 3e-4 and config["monitor"]["wandb"]["mode"] == "offline"
    rows = _history(records)
    assert [(r["_step"], r["reward/mean"], r["loss/mean"]) for r in rows] == [(1, 0.25, 2.0), (2, 0.5, 1.5)]
    assert rows[0]["samples/_type"] == "table-file" and rows[0]["samples/nrows"] == 2
    (files,) = wandb_dir.glob("wandb/offline-run-*/files")
    (table,) = files.glob("media/table/samples_*.table.json")
    data = json.loads(table.read_text())
    assert data["columns"] == ["prompt", "completion", "reward"] and len(data["data"]) == 2  # max_samples


def test_monitor_config_in_toml_and_help(tmp_path):
    toml = tmp_path / "m.toml"
    toml.write_text('[monitor.wandb]\nproject = "arith"\ntags = ["cpu"]\n')
    cfg = load_config(Run, ["@", str(toml)])
    assert cfg.monitor.wandb.project == "arith" and cfg.monitor.wandb.tags == ["cpu"]
    assert load_config(Run, ["--monitor.wandb"]).monitor.wandb.project == "prime-rl"
    assert load_config(Run, []).monitor.wandb is None
