"""`[monitor.wandb]` through the real processes, offline (WANDB_MODE=offline: no account, no network):
`sft` on the CPU example logs its metrics and config to a W&B run named `<run>-trainer`; the orchestrator
loop (fake inference server and trainer ranks) logs its metrics and sample tables to `<run>-orchestrator`.
Cross-package (trainer/orchestrator + common's wandb extra), hence here."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from packages.common.tests.test_monitor_wandb import _history, _records
from prime_rl.common.monitor import build_monitor, read_metrics
from prime_rl.common.rundir import RunDir

pytest.importorskip("wandb", reason="needs prime-rl-common[wandb]")

ROOT = Path(__file__).resolve().parents[1]
# a loaded 2-core CI machine can take longer than wandb's default 30 s to start its service process
SLOW_START = {"WANDB__SERVICE_WAIT": "300", "WANDB_INIT_TIMEOUT": "300"}
ENV = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", **SLOW_START}


def _finished_records(wandb_dir: Path) -> list:
    deadline = time.monotonic() + 30  # wandb's service process may still be flushing after finish()
    while True:
        records = _records(wandb_dir)
        if "exit" in [r.WhichOneof("record_type") for r in records] or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _run_record(records: list):
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    return run


def test_sft_on_the_cpu_example_logs_metrics_and_config_offline(tmp_path):
    example = ROOT / "examples" / "sft"
    subprocess.run([sys.executable, example / "make_example.py", "--out", tmp_path], check=True, env=ENV)
    cmd = [sys.executable, "-m", "prime_rl.trainer.sft.entrypoint", "@", example / "sft.toml",
           "--model.name", tmp_path / "model", "--data.path", tmp_path / "data.jsonl", "--output-dir", tmp_path,
           "--max-steps", "3", "--no-ckpt.export-hf", "--ckpt.interval", "None", "--monitor.wandb.project", "t"]  # fmt: skip
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, env=ENV)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = tmp_path / "run"
    assert [m["step"] for m in read_metrics(run_dir / "monitors/file/metrics.jsonl")] == [1, 2, 3]
    records = _finished_records(run_dir / "monitors" / "wandb")
    run = _run_record(records)
    assert (run.display_name, run.run_group, run.job_type) == ("run-trainer", "run", "trainer")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["model"]["name"] == str(tmp_path / "model") and config["max_steps"] == 3
    rows = [r for r in _history(records) if "loss/mean" in r]
    assert [r["_step"] for r in rows] == [1, 2, 3] and all("perf/throughput" in r for r in rows)


def test_orchestrator_logs_metrics_and_sample_tables_offline(tmp_path, monkeypatch):
    from packages.orchestrator.tests.conftest import FakeOpenAIServer, free_port_range
    from packages.orchestrator.tests.test_orchestrator_e2e import BoomEnv, FakeTrainer, RecordingControl, make_config
    from prime_rl.orchestrator.batch import BatchSender
    from prime_rl.orchestrator.client import InferenceClient
    from prime_rl.orchestrator.orchestrator import Orchestrator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for key, value in SLOW_START.items():
        monkeypatch.setenv(key, value)
    port = free_port_range(2)
    with FakeOpenAIServer() as server:
        wandb_cfg = {"max_samples": 3, "mode": "offline"}  # wandb reads $WANDB_MODE once per process
        config = make_config(tmp_path, server.base_url, port, monitor={"wandb": wandb_cfg})
        run_dir = RunDir(tmp_path, "run")
        trainer = FakeTrainer(run_dir, port, num_ranks=2, num_steps=3, weights_port=config.trainer.weights_port)

        async def go() -> None:
            client = InferenceClient(config.model.client.base_url, config.model.name, max_retries=1)
            sender = BatchSender("127.0.0.1", config.trainer.port, config.num_train_ranks, timeout=30)
            monitor = build_monitor(run_dir, config.monitor, "orchestrator", config.model_dump(mode="json"))
            try:
                orchestrator = Orchestrator(config, BoomEnv(min_len=3, max_len=6), client, RecordingControl(),
                                            sender.send, monitor)  # fmt: skip
                await asyncio.wait_for(orchestrator.run(), timeout=60)
            finally:
                await client.aclose()
                sender.close()
                monitor.close()

        asyncio.run(go())
        trainer.join()

    wandb_dir = run_dir.root / "monitors" / "wandb"
    records = _finished_records(wandb_dir)
    assert _run_record(records).display_name == "run-orchestrator"
    rows = [r for r in _history(records) if "reward/mean" in r]
    assert [r["_step"] for r in rows] == [1, 2, 3]
    tables = sorted(wandb_dir.glob("wandb/offline-run-*/files/media/table/samples_*.table.json"))
    assert len(tables) == 3
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["task", "completion", "reward", "advantage"] and len(table["data"]) == 3
