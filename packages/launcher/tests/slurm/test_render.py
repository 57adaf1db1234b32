"""Fast tests of the SLURM job scripts: what `--dry-run` writes, and what the rendered script does when run
with stand-in `srun` / `scontrol` (each call recorded) instead of a cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

from prime_rl.common.auth import RunSecret
from prime_rl.common.config import load_config, write_toml
from prime_rl.common.config.rl import RLConfig
from prime_rl.common.config.trainer import SFTConfig
from prime_rl.common.env import SECRET_FILE_ENV, STALL_TIMEOUT_ENV, TRAINER_LOG_DIR_ENV
from prime_rl.common.net import free_port, free_port_range
from prime_rl.common.testing_rl import merged, rl_config, write_rl_config
from prime_rl.launcher.slurm import load_job, render_job
from prime_rl.launcher.slurm.__main__ import main

# Records each call as one JSON line, then behaves as FAKE_FAIL / FAKE_HANG say for that step name.
FAKE_SRUN = r"""#!/usr/bin/env python3
import json, os, sys, time
name = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--job-name="))
with open(os.environ["FAKE_LOG"], "a") as f:
    env = {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "VLLM_CACHE_ROOT", "FLASHINFER_WORKSPACE_BASE",
                                          "MY_VAR", "PRIME_RL_TRAINER_LOG_DIR")}
    f.write(json.dumps({"name": name, "pid": os.getpid(), "argv": sys.argv[1:], "env": env}) + "\n")
for prefix, script in (e.split("=", 1) for e in os.environ.get("FAKE_EXEC", "").split(",") if e):
    if name.startswith(prefix):  # a stand-in plays the step (standin_steps.py), with srun's argv
        os.execvp(sys.executable, [sys.executable, script, *sys.argv[1:]])
if any(name.startswith(p) for p in os.environ.get("FAKE_FAIL", "").split(",") if p):
    time.sleep(0.5)
    sys.exit(3)
if name in os.environ.get("FAKE_STALL", "").split(","):  # a rank that beats, logs a line, then hangs
    beats = os.environ["PRIME_RL_HEARTBEAT_DIR"]
    os.makedirs(beats, exist_ok=True)
    now = time.time()
    beat = {"component": "trainer", "rank": 1, "pid": os.getpid(), "phase": "step", "step": 5, "since": now,
            "deadline_s": 1.0, "time": now, "log": ""}
    with open(os.path.join(beats, "trainer-1.json"), "w") as f:
        json.dump(beat, f)
    with open(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--output=")), "a") as f:
        f.write("Step 4 | loss 1.23\n")
    time.sleep(60)
if any(name.startswith(p) for p in os.environ.get("FAKE_HANG", "").split(",") if p):
    time.sleep(60)
if name == os.environ.get("FAKE_SERVE"):  # answer HTTP on the step's --port until stopped
    port = sys.argv[sys.argv.index("--port") + 1]
    os.execvp(sys.executable, [sys.executable, "-m", "http.server", port, "--bind", "127.0.0.1"])
"""
FAKE_SCONTROL = """#!/bin/sh
[ "$1 $2" = "show hostnames" ] && printf '%s\\n' $FAKE_NODES
"""
FAKE_SCANCEL = """#!/bin/sh
echo "$*" >>"$FAKE_LOG.scancel"
"""


def write_config(tmp_path: Path, kind: str = "sft", extra: str = "", deployment: str = "") -> Path:
    """An ``sft`` or ``inference`` SLURM job (``extra``: more ``[slurm]`` keys); ``rl`` jobs: ``write_rl_job``."""
    body = {
        "sft": 'run_name = "r"\n[model]\nname = "/models/tiny"\n[data]\ntype = "fake"\nseq_len = 64\nbatch_size = 48\n',
        "inference": 'run_name = "r"\n[model]\nname = "/models/tiny"\n',
    }[kind]
    path = tmp_path / f"{kind}.toml"
    path.write_text(
        f'output_dir = "{tmp_path / "out"}"\n{body}'
        f'[deployment]\ntype = "multi_node"\n{deployment}\n[slurm]\njob_name = "t"\n{extra}'
    )
    return path


def write_rl_job(tmp_path: Path, deployment: dict[str, int], **overrides: Any) -> Path:
    """An ``rl`` SLURM job on ``deployment``'s nodes (a model path that is not there: nothing loads it), with
    ``overrides`` (tables of the run's config) merged in."""
    config = rl_config(
        "/models/tiny", tmp_path / "out", "r", orchestrator={"max_tokens": 8},
        deployment={"type": "multi_node", **deployment}, slurm={"job_name": "t"},
    )  # fmt: skip
    return write_rl_config(tmp_path / "rl.toml", merged(config, overrides))


def run_script(script: Path, tmp_path: Path, nodes: list[str], **fake: str) -> tuple[subprocess.CompletedProcess, list]:
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("scancel", FAKE_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.jsonl"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_LOG": str(log),
        "FAKE_NODES": " ".join(nodes),
        "SLURM_JOB_NODELIST": "whatever[1-9]",
        "SLURM_JOB_ID": "77",
        **fake,
    }
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=60)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


def dry_run(cfg: Path, *flags: str) -> Path:
    assert main(["sft" if cfg.stem == "sft" else cfg.stem, "@", str(cfg), *flags, "--dry-run"]) == 0
    return cfg.parent / "out" / "r" / "launcher"


def arg_after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_dry_run_writes_script_and_per_process_configs(tmp_path: Path) -> None:
    launcher = dry_run(write_config(tmp_path, deployment="num_train_nodes = 2\ngpus_per_node = 4"))
    script = launcher / "sft.sbatch"
    assert script.is_file() and (launcher / "logs").is_dir()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "#SBATCH --nodes=2\n" in text and "#SBATCH --gres=gpu:4\n" in text
    assert f"#SBATCH --output={launcher}/logs/job_%j.log" in text
    assert "--partition" not in text  # unset: left to the cluster default
    # Each rank's config: the component's own schema, no [slurm], a single-node deployment.
    trainer = tmp_path / "out" / "r" / "configs" / "trainer.toml"
    cfg = load_config(SFTConfig, ["@", str(trainer)])
    assert cfg.deployment.type == "single_node" and not cfg.dry_run
    assert "[slurm]" not in trainer.read_text()
    # The submitted config is kept whole: loading it again gives the same script.
    again = load_job("sft", ["@", str(launcher / "sft.toml")])
    assert render_job(again) == text


def test_sbatch_header_from_slurm_table(tmp_path: Path) -> None:
    extra = 'partition = "gpu"\naccount = "proj"\ntime = "01:00:00"\n'
    text = (dry_run(write_config(tmp_path, extra=extra)) / "sft.sbatch").read_text()
    for line in (
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj",
        "#SBATCH --time=01:00:00",
        "#SBATCH --job-name=t",
    ):
        assert line in text


def test_sft_places_one_torchrun_per_node_with_rendezvous_on_the_head(tmp_path: Path) -> None:
    deployment = "num_train_nodes = 3\nnum_infer_nodes = 1\ngpus_per_node = 2"  # sft places no inference
    launcher = dry_run(write_config(tmp_path, deployment=deployment), "--slurm.rdzv-port", "29777")
    proc, calls = run_script(launcher / "sft.sbatch", tmp_path, ["a", "b", "c"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(c["name"] for c in calls) == ["trainer-node0", "trainer-node1", "trainer-node2"]
    for call in calls:
        argv = call["argv"]
        rank = int(call["name"].removeprefix("trainer-node"))
        assert "--kill-on-bad-exit=1" in argv
        assert f"--nodelist={'abc'[rank]}" in argv
        assert arg_after(argv, "--node-rank") == str(rank)
        assert arg_after(argv, "--nnodes") == "3"
        assert arg_after(argv, "--nproc-per-node") == "2"
        assert arg_after(argv, "--rdzv-endpoint") == "a:29777"
        assert argv[-3:] == [
            "prime_rl.trainer.sft.train",
            "@",
            str(tmp_path / "out" / "r" / "configs" / "trainer.toml"),
        ]
        assert call["env"][TRAINER_LOG_DIR_ENV] == str(tmp_path / "out/r/logs/attempt_1/trainer/torchrun")
    assert (launcher / "job_77.exitcode").read_text().strip() == "0"


def test_inference_replica_per_node_behind_router_on_node_zero(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "inference", deployment="num_infer_nodes = 2\nnum_train_nodes = 5")
    launcher = dry_run(cfg, "--slurm.router-port", "9000", "--slurm.replica-port", "9100")
    # The router fails; the replicas (still serving) are stopped and the job ends with its code.
    proc, calls = run_script(
        launcher / "inference.sbatch", tmp_path, ["a", "b"], FAKE_FAIL="router", FAKE_HANG="inference"
    )
    assert "router: http://a:9000/v1" in proc.stdout
    by_name = {c["name"]: c["argv"] for c in calls}
    assert sorted(by_name) == ["inference-node0", "inference-node1", "router"]
    for i, node in enumerate("ab"):
        argv = by_name[f"inference-node{i}"]
        assert f"--nodelist={node}" in argv and arg_after(argv, "--server.port") == str(9100 + i)
    router = by_name["router"]
    assert "--nodelist=a" in router and arg_after(router, "--port") == "9000"
    # its metrics on router_port + 1, loopback: vllm-router's fixed default (29000) made a second job's router
    # on a shared node die with "Address already in use"
    assert arg_after(router, "--prometheus-port") == "9001" and arg_after(router, "--prometheus-host") == "127.0.0.1"
    assert router[router.index("--worker-urls") + 1 : router.index("--worker-urls") + 3] == [
        "http://a:9100",
        "http://b:9101",
    ]
    assert proc.returncode == 3
    for call in calls:
        assert not pid_alive(call["pid"]), f"{call['name']} still running"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_first_failure_stops_the_other_components(tmp_path: Path) -> None:
    launcher = dry_run(write_config(tmp_path, deployment="num_train_nodes = 2"))
    started = time.monotonic()
    proc, calls = run_script(
        launcher / "sft.sbatch", tmp_path, ["a", "b"], FAKE_FAIL="trainer-node1", FAKE_HANG="trainer-node0"
    )
    assert proc.returncode == 3
    assert time.monotonic() - started < 30  # not the 60 s the hanging rank would take
    assert "trainer-node1 failed with exit code 3" in proc.stderr
    assert (launcher / "job_77.exitcode").read_text().strip() == "3"
    assert not any(pid_alive(c["pid"]) for c in calls)


def test_watchdog_ends_the_job_naming_a_stalled_rank(tmp_path: Path) -> None:
    """A rank that stops making progress (alive, silent) on another node ends the job within seconds, named
    with its step, rank, phase and last log line; the run's STATUS says so; no step is left running."""
    launcher = dry_run(write_config(tmp_path, deployment="num_train_nodes = 2"))
    assert "\nstart_watchdog " in (launcher / "sft.sbatch").read_text()
    started = time.monotonic()
    proc, calls = run_script(
        launcher / "sft.sbatch", tmp_path, ["a", "b"], FAKE_STALL="trainer-node1", FAKE_HANG="trainer-node0"
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert time.monotonic() - started < 30  # a 1 s deadline, not the 60 s the ranks would hang
    expected = "watchdog: trainer rank 1 (pid {pid}, trainer-node1) stalled in phase 'step' at step 5"
    stalled = next(c for c in calls if c["name"] == "trainer-node1")
    assert expected.format(pid=stalled["pid"]) in proc.stderr, proc.stderr
    assert f"last log line: Step 4 | loss 1.23 [{launcher / 'logs' / 'trainer-node1.log'}]" in proc.stderr
    status = json.loads((tmp_path / "out" / "r" / "logs" / "latest" / "STATUS").read_text())
    assert status["state"] == "failed" and "trainer rank 1" in status["reason"], status
    assert (launcher / "job_77.exitcode").read_text().strip() == "1"
    assert "--signal=CONT 77" in (tmp_path / "calls.jsonl.scancel").read_text()  # a SIGSTOPped rank wakes to die
    assert not any(pid_alive(c["pid"]) for c in calls)


def test_rl_job_beats_per_step_with_the_run_stall_timeout(tmp_path: Path) -> None:
    launcher = dry_run(write_rl_job(tmp_path, {"num_train_nodes": 1, "num_infer_nodes": 1}),
                       "--stall-timeout", "123")  # fmt: skip
    script = (launcher / "rl.sbatch").read_text()
    assert f'export {STALL_TIMEOUT_ENV}="123.0"' in script
    assert f"HEARTBEAT_DIR={tmp_path / 'out' / 'r' / 'heartbeats'}" in script
    assert "\nstart_watchdog " in script
    inference = dry_run(write_config(tmp_path, "inference", deployment="num_infer_nodes = 1"))
    assert "\nstart_watchdog " not in (inference / "inference.sbatch").read_text()  # nothing to watch alone


def test_rl_publishes_in_the_served_dtype_after_the_rl_hand_off(tmp_path: Path) -> None:
    """`rl` hands the module its whole resolved config (configs/rl.toml: every default written out), so the
    default weight_broadcast.dtype reads as set; it must still follow the dtype inference serves."""
    cfg = write_rl_job(tmp_path, {"num_train_nodes": 1, "num_infer_nodes": 1}, inference={"vllm": {"dtype": "float32"}})
    handed = write_toml(load_config(RLConfig, ["@", str(cfg)]), tmp_path / "handed.toml")  # as `rl` writes it
    assert 'dtype = "bfloat16"' in handed.read_text()
    assert main(["rl", "@", str(handed), "--dry-run"]) == 0
    trainer = (tmp_path / "out" / "r" / "configs" / "trainer.toml").read_text()
    assert 'dtype = "float32"' in trainer.split("[weight_broadcast]")[1].split("\n[")[0], trainer


def test_cache_dirs_are_node_local_and_env_vars_override(tmp_path: Path) -> None:
    extra = '[slurm.env_vars]\nTRITON_CACHE_DIR = "/scratch/triton"\nMY_VAR = "a \\"quoted\\" ${HOME}"\n'
    launcher = dry_run(write_config(tmp_path, extra=extra, deployment="num_train_nodes = 1"))
    proc, calls = run_script(launcher / "sft.sbatch", tmp_path, ["a"])
    assert proc.returncode == 0, proc.stderr
    env = calls[0]["env"]
    uid = os.getuid()
    assert env["TRITON_CACHE_DIR"] == "/scratch/triton"
    assert env["VLLM_CACHE_ROOT"] == f"/tmp/.vllm-cache-{uid}"
    assert env["FLASHINFER_WORKSPACE_BASE"] == f"/tmp/.flashinfer-cache-{uid}"
    assert env["MY_VAR"] == f'a "quoted" {os.environ["HOME"]}'


def test_custom_template_extends_the_packaged_one(tmp_path: Path) -> None:
    # Same file name as the packaged template: `extends` still means the packaged one.
    template = tmp_path / "sft.sbatch.j2"
    template.write_text(
        '{% extends "sft.sbatch.j2" %}\n'
        "{% block header %}{{ super() }}\n#SBATCH --constraint=h200{% endblock %}\n"
        "{% block setup %}{{ super() }}\necho custom setup on {{ num_train_nodes }} nodes{% endblock %}\n"
    )
    launcher = dry_run(write_config(tmp_path, deployment="num_train_nodes = 2"), "--slurm.template-path", str(template))
    text = (launcher / "sft.sbatch").read_text()
    assert "#SBATCH --constraint=h200" in text and "#SBATCH --nodes=2" in text
    proc, calls = run_script(launcher / "sft.sbatch", tmp_path, ["a", "b"])
    assert proc.returncode == 0 and "custom setup on 2 nodes" in proc.stdout
    assert len(calls) == 2


def test_install_step_runs_only_without_a_venv(tmp_path: Path) -> None:
    marker = tmp_path / "installed"
    extra = f'install_command = "touch {marker}"\n'
    launcher = dry_run(write_config(tmp_path, extra=extra, deployment="num_train_nodes = 1"))
    proc, _ = run_script(launcher / "sft.sbatch", tmp_path, ["a"])
    assert proc.returncode == 0 and "install: skipped" in proc.stdout and not marker.exists()
    # Point the job at a python that does not exist yet: the install step runs.
    text = (launcher / "sft.sbatch").read_text().replace(f"[ -x {sys.executable} ]", "[ -x /nonexistent/python ]")
    (launcher / "sft.sbatch").write_text(text)
    run_script(launcher / "sft.sbatch", tmp_path, ["a"])
    assert marker.exists()


@pytest.mark.parametrize(
    ("extra", "argv_extra", "needle"),
    [
        ("", ["--slurm.no-such-key", "1"], "unknown option --slurm.no-such-key"),
        ("bogus = 1\n", [], "bogus"),
        ("", ["--slurm.router-port", "9099", "--slurm.replica-port", "9100"], "also slurm.replica_port"),
    ],
)
def test_bad_config_exits_2_with_one_line(
    tmp_path: Path, capsys, extra: str, argv_extra: list[str], needle: str
) -> None:
    cfg = write_config(tmp_path, extra=extra)
    assert main(["sft", "@", str(cfg), *argv_extra, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("replica_port", "needle"),
    [
        ("65535", "slurm.replica_port=65535 puts inference node 1 on port 65536, above 65535; lower "
                  "slurm.replica_port by at least 1"),
        ("65436", "slurm.replica_port=65436 puts inference node 1 on port 65437, where server.port=65437 "
                  "(server.control_port=None) puts the control port at 65537, above 65535"),
        ("65434", None),  # node 1's control port is 65535: the last that fits
    ],
)  # fmt: skip
def test_a_replica_port_whose_last_node_passes_65535_is_refused_before_submitting(
    tmp_path: Path, capsys, replica_port: str, needle: str | None
) -> None:
    """Node i serves on replica_port + i and its control plane on + 100: refused at submission, not on the node."""
    cfg = write_rl_job(tmp_path, {"num_infer_nodes": 2, "num_train_nodes": 1, "gpus_per_node": 1})
    code = main(["rl", "@", str(cfg), "--slurm.replica-port", replica_port, "--dry-run"])
    err = capsys.readouterr().err
    if needle is None:
        assert code == 0, err
    else:
        assert code == 2 and needle in err and err.count("\n") == 1, err


def test_missing_slurm_table_is_an_error(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "sft.toml"
    cfg.write_text('[model]\nname = "/m"\n[data]\ntype = "fake"\n')
    assert main(["sft", "@", str(cfg), "--dry-run"]) == 2
    assert "slurm" in capsys.readouterr().err


def test_submit_without_sbatch_says_so(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    cfg = write_config(tmp_path)
    assert main(["sft", "@", str(cfg)]) == 1
    assert "'sbatch' is not on PATH" in capsys.readouterr().err
    assert (tmp_path / "out" / "r" / "launcher" / "sft.sbatch").is_file()


def args_after(argv: list[str], flag: str) -> list[str]:
    """The values of a list flag: everything up to the next --flag."""
    rest = argv[argv.index(flag) + 1 :]
    return rest[: next((k for k, a in enumerate(rest) if a.startswith("--")), len(rest))]


def test_rl_with_local_replicas_updates_and_probes_every_replica(tmp_path: Path) -> None:
    """Two replicas per inference node behind that node's router: a router forwards control requests and /metrics
    to one replica only, so the orchestrator gets every replica's control address (weight updates) and HTTP root
    (rollout concurrency), not the node's. Replica j of a node on port p: HTTP p + 1 + j, control p + 100 + j."""
    router_port = free_port(headroom=1)
    cfg = write_rl_job(tmp_path, {"num_infer_nodes": 2, "num_train_nodes": 1, "gpus_per_node": 2})
    flags = [
        "--slurm.router-port",
        str(router_port),
        "--slurm.replica-port",
        "9100",
        "--inference.router.replicas",
        "2",
    ]
    assert main(["rl", "@", str(cfg), *flags, "--dry-run"]) == 0
    proc, calls = run_script(
        tmp_path / "out" / "r" / "launcher" / "rl.sbatch", tmp_path, ["localhost", "i1", "t1"], FAKE_SERVE="router",
        FAKE_HANG="inference",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    by_name = {c["name"]: c["argv"] for c in calls}
    assert args_after(by_name["router"], "--worker-urls") == ["http://localhost:9100", "http://i1:9103"]
    orch = by_name["orchestrator"]
    assert args_after(orch, "--inference.addresses") == [
        "tcp://localhost:9200", "tcp://localhost:9201", "tcp://i1:9203", "tcp://i1:9204"
    ]  # fmt: skip
    assert args_after(orch, "--model.client.metrics-urls") == [
        "http://localhost:9101", "http://localhost:9102", "http://i1:9104", "http://i1:9105"
    ]  # fmt: skip


@pytest.mark.parametrize("broadcast", ["filesystem", "nccl", "nixl"])
def test_rl_places_inference_first_then_orchestrator_and_trainers(tmp_path: Path, broadcast: str) -> None:
    from prime_rl.common.config.orchestrator import OrchestratorConfig
    from prime_rl.common.config.rl_trainer import RLTrainerConfig

    router_port = free_port(headroom=1)
    cfg = write_rl_job(tmp_path, {"num_infer_nodes": 1, "num_train_nodes": 2, "gpus_per_node": 2})
    launcher = tmp_path / "out" / "r" / "launcher"
    flags = ["--slurm.router-port", str(router_port), "--slurm.replica-port", "9100", "--slurm.rdzv-port", "29777"]
    assert main(["rl", "@", str(cfg), *flags, "--weight-broadcast.type", broadcast, "--dry-run"]) == 0
    configs = tmp_path / "out" / "r" / "configs"
    assert load_config(RLTrainerConfig, ["@", str(configs / "trainer.toml")]).weight_broadcast.type == broadcast
    load_config(OrchestratorConfig, ["@", str(configs / "orchestrator.toml")])
    # "localhost" is the inference node, so the stand-in router can really answer the readiness check.
    proc, calls = run_script(
        launcher / "rl.sbatch", tmp_path, ["localhost", "t1", "t2"], FAKE_SERVE="router",
        FAKE_HANG="inference,nixl-metadata",  # services run until the mains are done
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = [c["name"] for c in calls]
    assert names.index("router") < names.index("orchestrator")  # started only once the router answered
    by_name = {c["name"]: c["argv"] for c in calls}
    # A service's stand-in may be stopped (the mains end at once here) before it records its call:
    # check the NIXL metadata service in the script instead.
    assert sorted(n for n in by_name if n != "nixl-metadata") == [
        "inference-node0", "orchestrator", "router", "trainer-node0", "trainer-node1"
    ]  # fmt: skip
    script = (launcher / "rl.sbatch").read_text()
    if broadcast == "nixl":  # the job-scoped NIXL metadata service, on the head trainer node, before the trainers
        start = script.index("start_component nixl-metadata")
        assert 'service "$TRAIN_HEAD"' in script[start : start + 80] and "prime_rl.common.nixl_metadata" in script
        assert start < script.index('start_component "trainer-node$i"')
    else:
        assert "nixl-metadata" not in script
    assert "--nodelist=localhost" in by_name["inference-node0"] and "--nodelist=localhost" in by_name["router"]
    assert arg_after(by_name["router"], "--worker-urls") == "http://localhost:9100"
    orch = by_name["orchestrator"]
    assert "--nodelist=t1" in orch
    assert arg_after(orch, "--model.client.base-url") == f"http://localhost:{router_port}/v1"
    assert arg_after(orch, "--model.client.metrics-urls") == "http://localhost:9100"  # each replica's /metrics
    if broadcast == "filesystem":  # the orchestrator has replicas load each published step
        assert arg_after(orch, "--inference.addresses") == "tcp://localhost:9200"
    else:  # the trainer pushes the weights itself; a load request would find only the marker
        assert "--inference.addresses" not in orch
    assert arg_after(orch, "--num-train-ranks") == "4"
    # Closed control plane across nodes: every process gets the run secret, control binds beyond
    # loopback (authenticated), and the HTTP key reaches the router and the orchestrator.
    secret = tmp_path / "out" / "r" / "control.secret"
    assert (secret.stat().st_mode & 0o777) == 0o600
    assert f'export {SECRET_FILE_ENV}="{secret.resolve()}"' in script
    assert arg_after(by_name["inference-node0"], "--server.control-host") == "0.0.0.0"
    http_key = RunSecret.load(secret).http_api_key
    assert arg_after(by_name["router"], "--api-key") == http_key == arg_after(orch, "--model.client.api-key")
    for rank, node in enumerate(["t1", "t2"]):
        argv = by_name[f"trainer-node{rank}"]
        assert f"--nodelist={node}" in argv and arg_after(argv, "--node-rank") == str(rank)
        assert arg_after(argv, "--rdzv-endpoint") == "t1:29777" and arg_after(argv, "--data.host") == "t1"
        assert ("--weight-broadcast.host" in argv) == (broadcast in ("nccl", "nixl"))
        if broadcast in ("nccl", "nixl"):
            assert arg_after(argv, "--weight-broadcast.inference-addresses") == "tcp://localhost:9200"
    assert not any(pid_alive(c["pid"]) for c in calls)  # the router was stopped when the mains finished
    status = json.loads((tmp_path / "out" / "r" / "logs" / "latest" / "STATUS").read_text())
    assert status["state"] == "finished"  # and it said "running" (with the script's pid) meanwhile


def test_rl_job_status_is_final_and_names_the_failed_component(tmp_path: Path) -> None:
    """Probe: STATUS stayed "running" after the job ended; under SLURM too it is final on every exit path."""
    cfg = write_rl_job(tmp_path, {"num_infer_nodes": 1, "num_train_nodes": 1, "gpus_per_node": 1})
    router_port = free_port(headroom=1)
    assert main(["rl", "@", str(cfg), "--slurm.router-port", str(router_port), "--dry-run"]) == 0
    launcher = tmp_path / "out" / "r" / "launcher"
    proc, _ = run_script(
        launcher / "rl.sbatch", tmp_path, ["localhost", "t1"], FAKE_SERVE="router", FAKE_HANG="inference",
        FAKE_FAIL="trainer-node0",
    )  # fmt: skip
    assert proc.returncode == 3, proc.stdout + proc.stderr
    status = json.loads((tmp_path / "out" / "r" / "logs" / "latest" / "STATUS").read_text())
    assert status["state"] == "failed" and status["reason"].startswith("trainer-node0 exited with code 3; see ")


def test_help_lists_component_deployment_and_slurm_options(capsys) -> None:
    assert main(["sft", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--slurm.template-path" in out and "--deployment.num-train-nodes" in out and "--data.seq-len" in out


def write_pd_config(tmp_path: Path, kind: str, pd: str) -> Path:
    """A P/D job: ``inference`` with [deployment] type = "disaggregated", ``rl`` with it in [inference.deployment]."""
    if kind == "rl":
        deployment = {"type": "disaggregated", **tomllib.loads(pd)}
        return write_rl_job(tmp_path, {"num_train_nodes": 1, "gpus_per_node": 2}, inference={"deployment": deployment})
    path = tmp_path / "inference.toml"
    body = f'run_name = "r"\n[model]\nname = "/models/tiny"\n[deployment]\ntype = "disaggregated"\n{pd}\n'
    path.write_text(f'output_dir = "{tmp_path / "out"}"\n{body}[slurm]\njob_name = "t"\n')
    return path


def test_inference_pd_places_prefill_then_decode_nodes_behind_the_pd_router(tmp_path: Path) -> None:
    from prime_rl.common.config.inference import InferenceConfig

    cfg = write_pd_config(tmp_path, "inference", 'num_prefill = 2\nnum_decode = 1\nkv_buffer_device = "cuda"')
    launcher = dry_run(
        cfg, "--slurm.router-port", "9000", "--slurm.replica-port", "9100", "--vllm.data-parallel-size", "2"
    )
    script = (launcher / "inference.sbatch").read_text()
    assert "#SBATCH --nodes=3" in script
    # each node's process config: the P/D deployment (the role comes as a flag), GPU connector settings
    per_node = load_config(InferenceConfig, ["@", str(tmp_path / "out" / "r" / "configs" / "inference.toml")])
    assert per_node.deployment.type == "disaggregated" and per_node.deployment.role is None
    assert per_node.deployment.kv_transfer_config("prefill") == {
        "kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cuda"
    }  # fmt: skip
    proc, calls = run_script(
        launcher / "inference.sbatch", tmp_path, ["a", "b", "c"], FAKE_FAIL="router", FAKE_HANG="inference"
    )
    by_name = {c["name"]: c["argv"] for c in calls}
    assert sorted(by_name) == ["inference-decode-node2", "inference-prefill-node0", "inference-prefill-node1", "router"]
    for i, (node, role) in enumerate([("a", "prefill"), ("b", "prefill"), ("c", "decode")]):
        argv = by_name[f"inference-{role}-node{i}"]
        assert f"--nodelist={node}" in argv and arg_after(argv, "--deployment.role") == role
        assert arg_after(argv, "--server.port") == str(9100 + i)
        # NIXL's side channel on the node's own address, a port per instance (nodes may share a network)
        assert f"VLLM_NIXL_SIDE_CHANNEL_HOST={node}" in argv and f"VLLM_NIXL_SIDE_CHANNEL_PORT={5600 + 2 * i}" in argv
    router = by_name["router"]
    start = router.index("--vllm-pd-disaggregation")
    assert router[start : start + 7] == [
        "--vllm-pd-disaggregation", "--prefill", "http://a:9100", "--prefill", "http://b:9101", "--decode",
        "http://c:9102",
    ]  # fmt: skip
    assert arg_after(router, "--kv-connector") == "nixl" and "--nodelist=a" in router
    assert proc.returncode == 3


def test_rl_pd_takes_its_inference_nodes_from_the_instance_counts(tmp_path: Path) -> None:
    cfg = write_pd_config(tmp_path, "rl", "num_prefill = 1\nnum_decode = 2")
    launcher = dry_run(cfg)
    script = (launcher / "rl.sbatch").read_text()
    assert "#SBATCH --nodes=4" in script and 'INFER_NODES=("${NODES[@]:0:3}")' in script
    assert "--vllm-pd-disaggregation" in script and "--deployment.role" in script


@pytest.mark.parametrize(
    ("kind", "pd", "flags", "message"),
    [
        ("inference", 'kv_connector = "SharedStorageConnector"', [], "is not a KV connector of the installed vLLM"),
        ("rl", "num_decode = 2", ["--deployment.num-infer-nodes", "2"], "set num_infer_nodes = 3"),
        ("rl", 'kv_connector = "ExampleConnector"', [], "KV computed by the old weights"),
        ("inference", "num_prefill = 0", [], "deployment.num_prefill"),
    ],
)
def test_pd_bad_input_is_one_line_exit_2(tmp_path: Path, capsys, kind: str, pd: str, flags: list[str], message: str):
    if "installed vLLM" in message:
        pytest.importorskip("vllm", reason="checks against the installed vLLM's connectors")
    cfg = write_pd_config(tmp_path, kind, pd)
    assert main([kind, "@", str(cfg), *flags, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out" / "r" / "launcher").exists()


def test_rl_with_context_parallelism_sends_per_data_parallel_group(tmp_path: Path) -> None:
    """cp=2 on 2 nodes x 2 GPUs: the orchestrator packs for the 2 data-parallel groups (one socket each)."""
    cfg = write_rl_job(tmp_path, {"num_infer_nodes": 1, "num_train_nodes": 2, "gpus_per_node": 2})
    launcher = dry_run(cfg, "--trainer.model.cp", "2")
    assert "--num-train-ranks 2 " in (launcher / "rl.sbatch").read_text()


def write_restart_job(tmp_path: Path, *flags: str) -> tuple[Path, int]:
    """An rl job with two inference nodes ("localhost", "127.0.0.1": both reachable here) and one trainer node; its
    script and the first replica's HTTP port (the second's is + 1, control + 100)."""
    replica_port = free_port_range(102, 10000, 20000)
    cfg = write_rl_job(tmp_path, {"num_infer_nodes": 2, "num_train_nodes": 1, "gpus_per_node": 1})
    ports = ["--slurm.router-port", str(free_port(headroom=1)), "--slurm.replica-port", str(replica_port)]
    assert main(["rl", "@", str(cfg), *ports, *flags, "--dry-run"]) == 0
    return tmp_path / "out" / "r" / "launcher" / "rl.sbatch", replica_port


def test_rl_restarts_render_with_the_budget_and_refuse_what_they_cannot_restart(tmp_path: Path, capsys) -> None:
    script, _ = write_restart_job(tmp_path, "--inference.max-restarts", "2", "--inference.restart-window", "600",
                                  "--inference.router.startup-timeout", "300")  # fmt: skip
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert "-m prime_rl.launcher.slurm.restarts died" in text and "-m prime_rl.launcher.slurm.restarts readmit" in text
    assert "--max-restarts 2\n  --window 600.0 " in text and "--timeout 300.0 " in text
    assert 'restart_replica "$name" "$code" && continue' in text and "\nINFERENCE_READY=1\n" in text
    assert text.index("INFERENCE_READY=1") > text.index('wait_ready router "')  # only once it was ready
    (tmp_path / "out").rename(tmp_path / "with-restarts")
    script, _ = write_restart_job(tmp_path)  # max_restarts = 0: a dead replica ends the job, as before
    assert "restart_replica" not in script.read_text() and "prime_rl.launcher.slurm.restarts" not in script.read_text()
    for flags in (["--inference.router.replicas", "2"], ["--weight-broadcast.type", "nccl"]):
        cfg = write_rl_job(tmp_path, {"num_infer_nodes": 2, "num_train_nodes": 1, "gpus_per_node": 2})
        assert main(["rl", "@", str(cfg), "--inference.max-restarts", "1", *flags, "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "inference.max_restarts=1 with " in err, err
    cfg = write_pd_config(tmp_path, "rl", "num_prefill = 1\nnum_decode = 1")
    assert main(["rl", "@", str(cfg), "--inference.max-restarts", "1", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "P/D instances" in err, err


def run_restart_job(tmp_path: Path, *flags: str, **fake: str) -> tuple[subprocess.CompletedProcess, list, int]:
    script, replica_port = write_restart_job(tmp_path, *flags)
    standins = Path(__file__).with_name("standin_steps.py")
    (tmp_path / "fake").mkdir()
    proc, calls = run_script(
        script, tmp_path, ["localhost", "127.0.0.1", "t1"], FAKE_DIR=str(tmp_path / "fake"),
        FAKE_EXEC=",".join(f"{step}={standins}" for step in ("inference-node", "router", "orchestrator")), **fake,
    )  # fmt: skip
    for call in calls:
        assert not pid_alive(call["pid"]), f"{call['name']} still running"
    return proc, calls, replica_port


@pytest.mark.chaos
def test_a_dead_replica_is_restarted_on_its_node_and_readmitted_once_it_serves_the_policy(tmp_path: Path) -> None:
    """SIGKILL of node 1's replica (stand-ins for replicas, router and orchestrator; the job script for real): out of
    the router, the same step started again on the same node, back into the router only once it serves the version
    the other serves; the run ends well; the death and the recovery are in the job log and STATUS."""
    proc, calls, port = run_restart_job(tmp_path, "--inference.max-restarts", "1", FAKE_KILL="inference-node1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    starts = [c["argv"] for c in calls if c["name"] == "inference-node1"]
    assert len(starts) == 2
    assert "--nodelist=127.0.0.1" in starts[1] and "--open-mode=append" in starts[1]  # same node, its log kept
    assert [a for a in starts[1] if a != "--open-mode=append"] == starts[0]  # the same command
    assert [c["name"] for c in calls].count("inference-node0") == 1  # the other replica served on
    worker = f"http%3A%2F%2F127.0.0.1%3A{port + 1}"
    fake = tmp_path / "fake"
    assert (fake / "router.calls").read_text().splitlines() == [
        f"/remove_worker?url={worker}",
        f"/add_worker?url={worker}",
    ]
    assert (fake / "orchestrator.out").read_text() == "ok\n"  # not re-added while it served the model's weights
    died = "inference-node1 on 127.0.0.1 died (SIGKILL) at "
    assert f"job: {died}" in proc.stderr and "removed from the router; restarting it (restart 1/1 within" in proc.stderr
    assert "job: inference-node1 is back after restart 1/1, serving weight version 3 (" in proc.stdout
    status = json.loads((fake / "status.json").read_text())
    assert status["state"] == "running" and status["restarts"] == 1 and status["pid"], status
    assert status["last_restart"].startswith("inference-node1 is back after restart 1/1"), status
    log = tmp_path / "out" / "r" / "launcher" / "logs" / "inference-node1.log"
    assert f"===== [job] {died}" in log.read_text()


@pytest.mark.chaos
@pytest.mark.parametrize(
    ("flags", "fake", "reason"),
    [
        ([], {"FAKE_RESTART_DIES": "inference-node1"}, "restart 1/1 died during start-up (exit 1)"),
        (["--inference.router.startup-timeout", "1"], {"FAKE_RELOAD": "never"},
         "restart 1/1 was not back serving the others' weights after 1s"),
    ],
    ids=["dies-during-start-up", "not-back-in-time"],
)  # fmt: skip
def test_a_failed_restart_ends_the_job_naming_both_causes(tmp_path: Path, flags, fake, reason) -> None:
    proc, _, _ = run_restart_job(tmp_path, "--inference.max-restarts", "1", *flags, FAKE_KILL="inference-node1", **fake)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    status = json.loads((tmp_path / "out" / "r" / "logs" / "latest" / "STATUS").read_text())
    assert status["state"] == "failed" and status["reason"].startswith(
        "inference-node1 on 127.0.0.1 died (SIGKILL) at "
    )
    assert status["reason"].endswith(f"; {reason}"), status["reason"]


@pytest.mark.chaos
def test_a_death_with_no_restart_left_ends_the_job_naming_every_death(tmp_path: Path) -> None:
    proc, _, _ = run_restart_job(tmp_path, "--inference.max-restarts", "1", FAKE_KILL="inference-node0,inference-node1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    reason = json.loads((tmp_path / "out" / "r" / "logs" / "latest" / "STATUS").read_text())["reason"]
    assert "no restart left (1/1 used within inference.restart_window=3600s; earlier: inference-node" in reason, reason
    assert reason.count("died (SIGKILL) at ") == 2, reason


@pytest.mark.chaos
def test_a_wedged_replica_is_restarted_like_a_dead_one_and_without_restarts_ends_the_job(
    tmp_path: Path,
) -> None:
    """Node 1's replica stays alive but its heartbeat passes its deadline (a wedged engine): the watchdog names it,
    the job script stops that step alone, and it takes a dead replica's path (out of the router, restarted on its
    node, back once it serves the policy). The job goes on; the cause in the job log and STATUS is the stall."""
    proc, calls, port = run_restart_job(tmp_path, "--inference.max-restarts", "1", FAKE_WEDGE="inference-node1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [c["name"] for c in calls].count("inference-node1") == 2
    assert [c["name"] for c in calls].count("inference-node0") == 1
    worker = f"http%3A%2F%2F127.0.0.1%3A{port + 1}"
    assert (tmp_path / "fake" / "router.calls").read_text().splitlines() == [
        f"/remove_worker?url={worker}",
        f"/add_worker?url={worker}",
    ]
    assert "stalled in phase 'serving'" in proc.stderr and "stopping inference-node1 to restart it" in proc.stderr
    stopped = "inference-node1 on 127.0.0.1 was stopped at "
    assert f"job: {stopped}" in proc.stderr and "removed from the router; restarting it (restart 1/1" in proc.stderr
    assert "job: inference-node1 is back after restart 1/1, serving weight version 3 (" in proc.stdout
    status = json.loads((tmp_path / "fake" / "status.json").read_text())
    assert status["restarts"] == 1 and status["state"] == "running", status

    # Without restarts the same stall ends the job naming it, as before.
    (tmp_path / "out").rename(tmp_path / "with-restarts")
    (tmp_path / "fake").rename(tmp_path / "fake-with-restarts")
    proc, _, _ = run_restart_job(tmp_path, FAKE_WEDGE="inference-node1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    reason = json.loads((tmp_path / "out" / "r" / "logs" / "latest" / "STATUS").read_text())["reason"]
    assert (
        reason.startswith("watchdog: inference rank 0 (pid ")
        and "inference-node1) stalled in phase 'serving'" in reason
    )


def srun_options(argv: list[str]) -> list[str]:
    """A step's srun options but its name and log files: what decides where it runs and which GPUs it gets."""
    options = argv[: next(k for k, a in enumerate(argv) if not a.startswith("--"))]
    return [o for o in options if not o.startswith(("--job-name=", "--output=", "--error="))]


@pytest.mark.parametrize("transport", ["ipc", "filesystem"])
def test_rl_colocated_runs_each_nodes_server_and_trainer_ranks_on_its_gpus_and_hands_over_every_server(
    tmp_path: Path, transport: str
) -> None:
    """`[deployment] type = "colocated"` on 2 nodes of 4 GPUs: each node runs one server (tensor x data parallel
    over its 4 GPUs) and one torchrun of 4 ranks, both steps placed alike (every GPU the job has on that node); the
    orchestrator, which puts inference to sleep after rollouts and wakes it, gets every node's control address.
    With ipc (the default) so do the trainer's ranks, in node order: node i's leader pushes into address i."""
    cfg = write_rl_job(
        tmp_path, {"type": "colocated", "num_gpus": 4, "num_nodes": 2},
        inference={"vllm": {"tensor_parallel_size": 2}}, orchestrator={"max_off_policy_steps": 0},
        **({} if transport == "ipc" else {"trainer": {"weight_broadcast": {"type": transport}}}),
    )  # fmt: skip
    flags = [
        "--slurm.router-port",
        str(free_port(headroom=1)),
        "--slurm.replica-port",
        "9100",
        "--slurm.rdzv-port",
        "29777",
    ]
    launcher = dry_run(cfg, *flags)
    script = (launcher / "rl.sbatch").read_text()
    assert "#SBATCH --nodes=2\n" in script and "#SBATCH --gres=gpu:4\n" in script  # the nodes both sides share
    inference = tomllib.loads((tmp_path / "out" / "r" / "configs" / "inference.toml").read_text())["vllm"]
    assert inference["tensor_parallel_size"] * inference["data_parallel_size"] == 4
    proc, calls = run_script(
        launcher / "rl.sbatch", tmp_path, ["localhost", "n2"], FAKE_SERVE="router", FAKE_HANG="inference"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "nodes: inference=localhost n2 trainer=localhost n2" in proc.stdout
    by_name = {c["name"]: c["argv"] for c in calls}
    controls = ["tcp://localhost:9200", "tcp://n2:9201"]
    for i, node in enumerate(["localhost", "n2"]):
        server, trainer = by_name[f"inference-node{i}"], by_name[f"trainer-node{i}"]
        assert srun_options(server) == srun_options(trainer)  # same node, same GPUs: no step asks for fewer
        assert f"--nodelist={node}" in trainer and "--overlap" in trainer  # steps share the node's GPUs
        assert (arg_after(trainer, "--nnodes"), arg_after(trainer, "--node-rank")) == ("2", str(i))
        assert (
            arg_after(trainer, "--nproc-per-node") == "4" and arg_after(trainer, "--rdzv-endpoint") == "localhost:29777"
        )
        if transport == "ipc":  # every node's servers, node by node: the order torchrun numbers the nodes
            assert args_after(trainer, "--weight-broadcast.inference-addresses") == controls
        else:
            assert "--weight-broadcast.inference-addresses" not in trainer  # filesystem: the orchestrator loads
    orch = by_name["orchestrator"]
    assert "--nodelist=localhost" in orch and arg_after(orch, "--num-train-ranks") == "8"
    assert args_after(orch, "--inference.addresses") == controls
    trainer_cfg = tomllib.loads((tmp_path / "out" / "r" / "configs" / "trainer.toml").read_text())
    assert trainer_cfg["weight_broadcast"]["type"] == transport and trainer_cfg["offload_between_steps"]
    orch_cfg = tomllib.loads((tmp_path / "out" / "r" / "configs" / "orchestrator.toml").read_text())
    assert orch_cfg["inference"]["sleep_level"] == 2 and orch_cfg["max_off_policy_steps"] == 0


def test_rl_colocated_share_reaches_every_server_and_a_failed_sizing_ends_the_job(tmp_path: Path) -> None:
    """vLLM's share is sized on the first node (`slurm.colocated`) and passed to every node's server; when the
    sizing refuses the run (here: a stand-in that says the model cannot fit) the job ends naming it, before any
    component starts."""
    cfg = write_rl_job(
        tmp_path, {"type": "colocated", "num_gpus": 1, "num_nodes": 2}, orchestrator={"max_off_policy_steps": 0}
    )
    launcher = dry_run(cfg, "--slurm.router-port", str(free_port(headroom=1)), "--slurm.replica-port", "9100")
    script = launcher / "rl.sbatch"
    sizing = f"{sys.executable} -m prime_rl.launcher.slurm.colocated"
    assert sizing in script.read_text()
    share = script.parent / "share.sbatch"
    share.write_text(script.read_text().replace(sizing, "sh -c 'echo 0.42'"))  # the job's rl.toml: its $0
    proc, calls = run_script(share, tmp_path, ["localhost", "n2"], FAKE_SERVE="router", FAKE_HANG="inference")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    servers = [c["argv"] for c in calls if c["name"].startswith("inference-node")]
    assert len(servers) == 2 and all(arg_after(s, "--vllm.gpu-memory-utilization") == "0.42" for s in servers)
    refused = script.parent / "refused.sbatch"
    refused.write_text(script.read_text().replace(sizing, "sh -c 'echo colocated: a model of 8B needs 40 GiB; exit 2'"))
    (tmp_path / "calls.jsonl").unlink()
    proc, calls = run_script(refused, tmp_path, ["localhost", "n2"])
    assert proc.returncode == 2 and calls == []
    assert "job: colocated: a model of 8B needs 40 GiB" in proc.stderr
    status = json.loads((tmp_path / "out" / "r" / "logs" / "latest" / "STATUS").read_text())
    assert status["state"] == "failed" and "needs 40 GiB" in status["reason"]


def test_rl_colocated_on_one_node_pushes_through_ipc_and_the_orchestrator_still_hands_over(tmp_path: Path) -> None:
    """One node: trainer rank 0 and the server share a host, so ipc (the colocated default) pushes as on one
    machine; the orchestrator, though it loads nothing then, still gets the server's control address to sleep it."""
    cfg = write_rl_job(tmp_path, {"type": "colocated", "num_gpus": 2}, orchestrator={"max_off_policy_steps": 0})
    launcher = dry_run(cfg, "--slurm.router-port", str(free_port(headroom=1)), "--slurm.replica-port", "9100")
    trainer_cfg = tomllib.loads((tmp_path / "out" / "r" / "configs" / "trainer.toml").read_text())
    assert trainer_cfg["weight_broadcast"]["type"] == "ipc"
    proc, calls = run_script(
        launcher / "rl.sbatch", tmp_path, ["localhost"], FAKE_SERVE="router", FAKE_HANG="inference"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    by_name = {c["name"]: c["argv"] for c in calls}
    assert args_after(by_name["orchestrator"], "--inference.addresses") == ["tcp://localhost:9200"]
    trainer = by_name["trainer-node0"]
    assert args_after(trainer, "--weight-broadcast.inference-addresses") == ["tcp://localhost:9200"]
    assert arg_after(trainer, "--weight-broadcast.host") == "localhost"  # ipc's bucket channel, on this node
