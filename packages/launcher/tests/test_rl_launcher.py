"""`rl` without starting anything heavy: config validation, dry run, GPU placement, side-by-side runs."""

import json
import subprocess
import sys
import time
import tomllib

import pytest

from prime_rl.common.config import load_config
from prime_rl.common.config.base import ConfigError
from prime_rl.common.config.deployment import SingleNodeDeployment
from prime_rl.common.config.rl import RLConfig
from prime_rl.common.rundir import RunDir
from prime_rl.common.testing import make_tiny_model
from prime_rl.common.testing_rl import rl_config, write_rl_config
from prime_rl.launcher.host_facts import gather_local
from prime_rl.launcher.resolution import resolve
from prime_rl.launcher.rl import PlacementError, place, shared_gpu_check

HEAVY_MODULES = ("torch", "vllm", "numpy", "zmq", "msgspec", "urllib.request", "prime_rl.launcher.supervisor")
"""Modules that neither `rl --help` nor `rl --dry-run` may import (a run imports them where it uses them)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", dtype="float32")


def _rl(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "prime_rl.launcher.rl", *args], capture_output=True, text=True, cwd=cwd
    )


def test_dry_run_writes_every_resolved_config_without_torch(model_dir, tmp_path):
    t0 = time.perf_counter()
    code = (
        "import sys; from prime_rl.launcher.rl import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        f"heavy = [m for m in {HEAVY_MODULES!r} if m in sys.modules]\n"
        "assert not heavy, f'rl --dry-run imported {heavy}'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, "--model.name", str(model_dir), "--output-dir", str(tmp_path),
         "--run.name", "exp1", "--max-steps", "3", "--trainer.model.ac.mode", "selective", "--dry-run"],
        capture_output=True, text=True,
    )  # fmt: skip
    elapsed = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    configs = tmp_path / "exp1" / "configs"
    assert {p.name for p in configs.iterdir()} == {"rl.toml", "trainer.toml", "orchestrator.toml", "inference.toml"}
    trainer = tomllib.loads((configs / "trainer.toml").read_text())
    orch = tomllib.loads((configs / "orchestrator.toml").read_text())
    assert trainer["model"]["name"] == str(model_dir) and trainer["max_steps"] == 3
    assert orch["max_steps"] == 3 and orch["run_name"] == "exp1"
    assert trainer["data"]["port"] == orch["trainer"]["port"]  # the trainer pulls where the orchestrator pushes
    assert trainer["weight_broadcast"]["dtype"] == "float32"  # what inference serves ("auto" = checkpoint)
    assert elapsed < 10
    # the resolved configs re-run as they are
    from prime_rl.common.config.rl_trainer import RLTrainerConfig

    assert load_config(RLTrainerConfig, ["@", str(configs / "trainer.toml")]).max_steps == 3


def test_bad_config_is_one_line_exit_2(model_dir, tmp_path):
    config = rl_config(model_dir, tmp_path, "bad", orchestrator={"batch_size": 10, "group_size": 3})
    bad = write_rl_config(tmp_path / "bad.toml", config)
    out = _rl("@", str(bad), "--model.name", str(model_dir), "--dry-run")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "batch_size=10 must be a multiple of group_size=3" in out.stderr
    out = _rl("--model.name", str(model_dir), "--trainer.modle.seq-len", "3")
    assert out.returncode == 2 and "unknown option --trainer.modle.seq-len" in out.stderr


def test_gpu_placement_inference_first_then_trainer():
    dep = SingleNodeDeployment(num_infer_gpus=6, num_train_gpus=2)
    assert place(dep, [str(i) for i in range(8)]) == (["0", "1", "2", "3", "4", "5"], ["6", "7"])
    assert place(SingleNodeDeployment(), ["2", "3"]) == (["2"], ["3"])  # CUDA_VISIBLE_DEVICES=2,3
    assert place(SingleNodeDeployment(), []) == ([], [])  # CPU machine
    with pytest.raises(PlacementError, match="asks for 6 inference \\+ 2 trainer GPUs = 8, but 4 are visible"):
        place(dep, ["0", "1", "2", "3"])
    # num_infer_gpus = 0 on a GPU machine: inference is placed on the trainer's GPU, explicitly
    assert place(SingleNodeDeployment(num_infer_gpus=0), ["3"]) == (["3"], ["3"])


def test_shared_gpu_memory_share_that_starves_the_trainer_is_one_line():
    h200, params = 140 * 2**30, 1_720_000_000  # Qwen3-1.7B on one H200
    assert shared_gpu_check(0.35, h200, params) is None
    error = shared_gpu_check(0.99, h200, params)
    assert error is not None and "\n" not in error
    assert "gpu_memory_utilization=0.99 leaves the trainer 1.4 GiB" in error and "at most 0.93" in error
    most = float(error.split("at most ")[1].split(",")[0])
    assert shared_gpu_check(most, h200, params) is None  # the value it suggests works
    assert shared_gpu_check(0.99, None, params) is None  # no nvidia-smi: nothing to check against


def test_two_runs_side_by_side_do_not_collide(model_dir):
    """scaling.md's A/B recipe: a second run differs by inference port and run name only."""
    a = load_config(RLConfig, ["--model.name", str(model_dir), "--run.name", "exp1"])
    b = load_config(
        RLConfig,
        ["--model.name", str(model_dir), "--inference.server.port", "8001",
         "--orchestrator.model.client.base-url", "http://localhost:8001/v1", "--run.name", "exp2"],
    )  # fmt: skip
    a = resolve(a, gather_local(a, RunDir(a.output_dir, a.run.name))).config
    b = resolve(b, gather_local(b, RunDir(b.output_dir, b.run.name))).config
    assert a.run_dir != b.run_dir
    ports = lambda c: {  # noqa: E731
        c.inference.server.port,
        c.inference.server.resolved_control_port,
        c.orchestrator.trainer.port,
    }
    assert not ports(a) & ports(b)
    assert b.orchestrator.inference.addresses == ["tcp://127.0.0.1:8101"]
    assert b.orchestrator.model.client.base_url == "http://localhost:8001/v1"


_RESOLVE_AND_HOLD = """
import json, sys
from prime_rl.common.config import load_config
from prime_rl.common.config.rl import RLConfig
from prime_rl.common.rundir import RunDir
from prime_rl.launcher.host_facts import gather_local
from prime_rl.launcher.resolution import resolve
cfg = load_config(RLConfig, sys.argv[1:])
cfg = resolve(cfg, gather_local(cfg, RunDir(cfg.output_dir, cfg.run.name))).config
wb = cfg.trainer.weight_broadcast
print(json.dumps([*range(cfg.orchestrator.trainer.port, cfg.orchestrator.trainer.port + 2),
                  cfg.orchestrator.trainer.weights_port, wb.port]), flush=True)
sys.stdin.read()  # hold the reservation, as a running launcher does, until the test closes stdin
"""


@pytest.mark.chaos
def test_two_launches_at_the_same_second_reserve_disjoint_ports(model_dir, tmp_path):
    """Probe (issue 35): the launcher took internal ports with free_port() from the ephemeral range and a
    child bound them seconds later, so two launches at once could take the same port. Two launchers of the
    *same* run directory (same derived offset: the worst case) resolve at once; while both are alive, their
    batch ports (2 ranks), announcement and broadcast ports are disjoint and above the ephemeral range."""
    from prime_rl.common.net import reserved_port_range

    args = ["--model.name", str(model_dir), "--output-dir", str(tmp_path), "--run.name", "same",
            "--deployment.num-train-gpus", "2", "--trainer.weight-broadcast.type", "nccl"]  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RESOLVE_AND_HOLD, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    try:
        ports = [json.loads(p.stdout.readline() or "null") for p in procs]
        assert all(ports), [p.stderr.read() for p in procs if p.poll() is not None]
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=30)
    a, b = (set(x) for x in ports)
    assert len(a) == len(b) == 4 and not a & b, ports
    low, high = reserved_port_range()
    assert all(low <= port < high for port in a | b)


def test_scaling_page_placement_flags_parse(model_dir):
    cfg = load_config(
        RLConfig,
        ["--model.name", str(model_dir), "--deployment.num-infer-gpus", "6", "--deployment.num-train-gpus", "2",
         "--inference.vllm.data-parallel-size", "6"],
    )  # fmt: skip
    assert cfg.deployment.num_infer_gpus == 6 and cfg.inference.vllm.data_parallel_size == 6
    assert cfg.orchestrator.num_train_ranks == 2


def test_shared_ckpt_resumes_trainer_and_orchestrator_together(model_dir):
    cfg = load_config(
        RLConfig, ["--model.name", str(model_dir), "--ckpt.interval", "5", "--ckpt.resume-step", "latest"]
    )
    assert cfg.trainer.ckpt.interval == 5 and cfg.orchestrator.ckpt.interval == 5
    assert cfg.trainer.ckpt.resume_step == "latest" and cfg.orchestrator.ckpt.resume_step == "latest"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--trainer.model.cp", "7"], "rl: error: trainer.model.cp=7 must divide the 1 rank of an FSDP island"),
        (["--trainer.model.cp", "3", "--deployment.num-train-gpus", "3"], "num_attention_heads=4; use 1, 2 or 4"),
        (["--trainer.model.dp-replicate", "2"], "deployment.num_train_gpus=1 must be divisible by"),
        (["--trainer.model.cp", "2", "--deployment.num-train-gpus", "3"], "trainer.model.cp=2 must divide the 3 ranks"),
    ],
)
def test_dry_run_refuses_a_layout_the_trainer_would_refuse(model_dir, tmp_path, flags, message):
    out = _rl("--model.name", str(model_dir), "--output-dir", str(tmp_path), *flags, "--dry-run")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert message in out.stderr and "from --trainer.model." in out.stderr
    assert not (tmp_path / "rl" / "configs").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--inference.vllm.max-model-len", "4096"], "inference.vllm.max_model_len=4096 is above seq_len=2048"),
        (
            ["--seq-len", "8192", "--inference.vllm.max-model-len", "8192"],
            "above the model's max_position_embeddings=4096",
        ),
        (["--inference.vllm.max-model-len", "256", "--orchestrator.sampling.max-tokens", "300"], "leaves no room"),
        (["--orchestrator.seq-len", "1024"], "orchestrator.seq_len=1024 but trainer.data.seq_len=2048"),
    ],
)
def test_dry_run_refuses_lengths_that_do_not_fit(model_dir, tmp_path, flags, message):
    """seq_len, max_model_len, max_tokens and the model's context (config/context.py): one line, keys named."""
    out = _rl("--model.name", str(model_dir), "--output-dir", str(tmp_path), *flags, "--dry-run")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert message in out.stderr and "on the command line)" in out.stderr
    assert not (tmp_path / "rl" / "configs").exists()
    out = _rl("--model.name", str(model_dir), "--output-dir", str(tmp_path), "--seq-len", "8192", "--dry-run")
    assert out.returncode == 0, out.stderr  # unset: seq_len capped at the model's context
    assert tomllib.loads((tmp_path / "rl" / "configs" / "inference.toml").read_text())["vllm"]["max_model_len"] == 4096


def test_context_parallel_rl_sends_per_data_parallel_group(model_dir, tmp_path):
    """cp=2 on 4 trainer ranks: the orchestrator packs for 2 data-parallel groups (one socket each)."""
    out = _rl("--model.name", str(model_dir), "--output-dir", str(tmp_path), "--trainer.model.cp", "2",
              "--deployment.num-train-gpus", "4", "--dry-run")  # fmt: skip
    assert out.returncode == 0, out.stderr
    cfg = load_config(RLConfig, ["--model.name", str(model_dir), "--trainer.model.cp", "2",
                                 "--deployment.num-train-gpus", "4"])  # fmt: skip
    assert cfg.orchestrator.num_train_ranks == 2


def test_dry_run_warns_about_ep_on_a_dense_model_and_a_missing_model_is_an_error(model_dir, tmp_path):
    out = _rl("--model.name", str(model_dir), "--output-dir", str(tmp_path), "--trainer.model.ep", "2",
              "--deployment.num-train-gpus", "2", "--dry-run")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [f"rl: warning: trainer.model.ep=2 has no effect: {model_dir} is a dense model "
                                       "(no experts); remove it"]  # fmt: skip
    out = _rl("--model.name", str(tmp_path / "nope"), "--inference.vllm.dtype", "float32", "--dry-run")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "is not a local Hugging Face model directory (no config.json)" in out.stderr
    assert "(from --model.name on the command line)" in out.stderr


def test_any_vllm_key_on_the_command_line(model_dir, tmp_path):
    out = _rl("--model.name", str(model_dir), "--output-dir", str(tmp_path), "--inference.vllm.max-num-seqs", "8",
              "--inference.vllm.enable-prefix-caching", "--dry-run")  # fmt: skip
    assert out.returncode == 0, out.stderr
    vllm = tomllib.loads((tmp_path / "rl" / "configs" / "inference.toml").read_text())["vllm"]
    assert vllm["max_num_seqs"] == 8 and vllm["enable_prefix_caching"] is True


def test_help_imports_nothing_heavy():
    """`rl --help` (and --dry-run, above) import no numpy, ZeroMQ, HTTP client or torch: they cost 0.1 s of a
    0.5 s `--help`; a run imports them where it uses them (benchmarks/cli_startup.py measures the time)."""
    code = (
        "import sys; from prime_rl.launcher.rl import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        f"heavy = [m for m in {HEAVY_MODULES!r} if m in sys.modules]\n"
        "assert not heavy, f'rl --help imported {heavy}'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "--trainer.model.name" in out.stdout


def test_help_is_grouped_and_shows_required_fields():
    out = _rl("--help")
    assert out.returncode == 0 and "PydanticUndefined" not in out.stdout
    assert "[trainer.model]" in out.stdout and "--trainer.model.name STR          (required)" in out.stdout
    assert '--deployment.type {single_node,multi_node,colocated}  (default: "single_node")' in out.stdout


@pytest.mark.chaos
def test_inference_is_ready_only_for_its_own_run(model_dir, tmp_path):
    """Probe: a second run on the same port was declared ready against the first run's server."""
    import http.server
    import threading

    from prime_rl.common.auth import RunSecret
    from prime_rl.common.net import free_port
    from prime_rl.common.transport import ControlServer
    from prime_rl.common.wire import HealthReply
    from prime_rl.launcher.rl import inference_ready

    first, second = RunSecret.create(tmp_path / "a.secret"), RunSecret.create(tmp_path / "b.secret")

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    http_server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    control_port = free_port()
    control = ControlServer(f"tcp://127.0.0.1:{control_port}", secret=first)
    stop = threading.Event()
    threads = [
        threading.Thread(target=http_server.serve_forever, daemon=True),
        threading.Thread(
            target=control.serve_forever, args=(lambda m, a: HealthReply(ok=True, run_id=first.run_id), stop)
        ),
    ]
    for t in threads:
        t.start()
    try:
        cfg = load_config(
            RLConfig,
            ["--model.name", str(model_dir), "--inference.server.port", str(http_server.server_port),
             "--inference.server.control-port", str(control_port)],
        )  # fmt: skip
        assert inference_ready(cfg, first)
        assert not inference_ready(cfg, second)  # the first run's server: its CURVE keys are not ours
    finally:
        stop.set()
        http_server.shutdown()
        threads[1].join()
        control.close()


@pytest.mark.chaos
def test_status_is_final_when_the_launcher_is_stopped(model_dir, tmp_path):
    """Probe: STATUS stayed "running" after the launcher died. Also: the run secret is private."""
    import json
    import os
    import signal
    import stat

    proc = subprocess.Popen(
        [sys.executable, "-m", "prime_rl.launcher.rl", "--model.name", str(model_dir), "--output-dir", str(tmp_path),
         "--run.name", "r", "--inference.server.port", "18555"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    status = tmp_path / "r" / "logs" / "latest" / "STATUS"
    deadline = time.monotonic() + 30
    while not status.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the launcher never wrote STATUS"
        time.sleep(0.1)
    assert json.loads(status.read_text())["state"] == "running"
    assert stat.S_IMODE((tmp_path / "r" / "control.secret").stat().st_mode) == 0o600
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    final = json.loads(status.read_text())
    assert final["state"] == "failed" and "SIGTERM" in final["reason"], final
    assert os.path.exists(tmp_path / "r" / "control.secret")


def test_rl_marks_the_attempt_of_a_sigkilled_launcher_failed(model_dir, tmp_path):
    """Probe: a SIGKILLed launcher left attempt_1/STATUS at "running"; the next `rl` settles it as failed."""
    import json
    import signal
    import socket

    from prime_rl.common.rundir import RunDir
    from prime_rl.launcher.dashboard.status import write_status

    run = RunDir(tmp_path, "r")
    run.start_attempt()
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    write_status(run.root, "running", pid=killed.pid, host=socket.gethostname())  # what the killed one left
    proc = subprocess.Popen(
        [sys.executable, "-m", "prime_rl.launcher.rl", "--model.name", str(model_dir), "--output-dir", str(tmp_path),
         "--run.name", "r", "--inference.server.port", "18556"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    status = tmp_path / "r" / "logs" / "attempt_2" / "STATUS"
    deadline = time.monotonic() + 30
    try:
        while not status.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the launcher never wrote STATUS"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    first = json.loads((tmp_path / "r" / "logs" / "attempt_1" / "STATUS").read_text())
    assert first["state"] == "failed" and f"pid {killed.pid}" in first["reason"], first
    assert "died without a final status" in first["reason"]


def test_resume_latest_is_resolved_once_for_both_components(model_dir, tmp_path):
    """Probe: "latest" resolved by each component resumed them at steps 8 and 4 (then hung)."""
    run = RunDir(tmp_path, "r")
    for step, parts in ((4, ("trainer", "orchestrator")), (8, ("orchestrator",))):
        for part, marker in (("trainer", ".done"), ("orchestrator", "state.json")):
            if part in parts:
                (run.checkpoint_dir(step) / part).mkdir(parents=True)
                (run.checkpoint_dir(step) / part / marker).write_text("{}")
    flags = ["--model.name", str(model_dir), "--output-dir", str(tmp_path), "--run.name", "r"]
    cfg = load_config(RLConfig, [*flags, "--ckpt.resume-step", "latest"])
    resolved = resolve(cfg, gather_local(cfg, run))
    assert resolved.resume_step == 4
    assert resolved.trainer.ckpt.resume_step == resolved.orchestrator.ckpt.resume_step == 4
    cfg = load_config(RLConfig, [*flags, "--trainer.ckpt.resume-step", "8", "--orchestrator.ckpt.resume-step", "4"])
    with pytest.raises(ConfigError, match="differ"):
        gather_local(cfg, run)
    # The launcher refuses a step that is not complete for both, naming the complete ones (exit 2).
    out = _rl(*flags, "--ckpt.resume-step", "8", "--dry-run")
    assert out.returncode == 2 and "complete steps: [4]" in out.stderr, out.stderr


def test_a_disk_too_small_for_the_checkpoints_is_named_before_the_run(model_dir, tmp_path, monkeypatch):
    import math
    import shutil
    from collections import namedtuple

    from prime_rl.common.weight_checksum import safetensors_layout
    from prime_rl.launcher.rl import check_disk, disk_needed

    flags = ["--model.name", str(model_dir), "--output-dir", str(tmp_path), "--ckpt.interval", "5"]
    cfg = load_config(RLConfig, flags)
    need = disk_needed(cfg)
    _, header = safetensors_layout(model_dir / "model.safetensors")
    num_params = sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    assert cfg.trainer.weight_broadcast.dtype == "bfloat16"  # resolve() sets the served dtype at launch
    assert need == num_params * 12 * (3 + 1) + num_params * 2 * (2 + 1)  # keep_last 3 (+1 being written)
    assert check_disk(cfg, tmp_path / "run") is None  # this machine has room for a tiny model
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * need, 9 * need, need // 2))
    warning = check_disk(cfg, tmp_path / "run")
    assert warning is not None and f"{tmp_path} has" in warning and "ckpt.keep_last=3" in warning


def test_pd_inference_in_rl_updates_every_instance(model_dir, tmp_path):
    pd = ["--inference.deployment.type", "disaggregated", "--inference.deployment.num-decode", "2"]
    out = _rl("--model.name", str(model_dir), "--output-dir", str(tmp_path), *pd, "--dry-run")
    assert out.returncode == 0, out.stderr
    configs = tmp_path / "rl" / "configs"
    inference = tomllib.loads((configs / "inference.toml").read_text())
    assert inference["deployment"]["type"] == "disaggregated" and inference["deployment"]["num_decode"] == 2
    control = inference["server"]["port"] + 100
    # the orchestrator loads each published step into the prefill instance and both decode instances
    addresses = tomllib.loads((configs / "orchestrator.toml").read_text())["inference"]["addresses"]
    assert addresses == [f"tcp://127.0.0.1:{control + i}" for i in range(3)]
    # rollout concurrency follows every instance's /metrics (vllm-router proxies /metrics to one of them)
    client = tomllib.loads((configs / "orchestrator.toml").read_text())["model"]["client"]
    port = inference["server"]["port"]
    assert client["metrics_urls"] == [f"http://127.0.0.1:{port + 1 + i}" for i in range(3)]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--inference.deployment.num-prefill", "0"], "inference.deployment.num_prefill"),
        (["--inference.deployment.kv-connector", "ExampleConnector"], "KV computed by the old weights"),
        (["--inference.deployment.kv-connector", "P2pNcclConnector"], "is not a KV connector of the installed vLLM"),
        (["--deployment.type", "disaggregated"], "places inference only, not the trainer"),
    ],
)
def test_pd_bad_input_is_one_line_before_anything_starts(model_dir, tmp_path, flags, message):
    if "installed vLLM" in message:
        pytest.importorskip("vllm", reason="checks against the installed vLLM's connectors")
    pd = flags if flags[0] == "--deployment.type" else ["--inference.deployment.type", "disaggregated", *flags]
    out = _rl("--model.name", str(model_dir), "--output-dir", str(tmp_path), *pd, "--dry-run")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert message in out.stderr
    assert not (tmp_path / "rl" / "configs").exists()


@pytest.mark.parametrize("dispatch,needs", [("mega_moe", "deep_gemm.mega_moe_dispatch"), ("deepep", "`deep_ep`")])
def test_missing_moe_dispatch_kernels_are_one_line_exit_2_before_anything_starts(
    tmp_path, monkeypatch, capsys, dispatch, needs
):
    """As `sft` and `trainer` do: not a traceback from every trainer rank after inference has started."""
    from prime_rl.launcher.rl import main

    model_dir = make_tiny_model(tmp_path / "moe", kind="qwen3_moe", dtype="float32")
    for module in ("deep_ep", "deep_gemm"):  # import -> ImportError, installed or not
        monkeypatch.setitem(sys.modules, module, None)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["--model.name", str(model_dir), "--output-dir", str(out), "--trainer.model.moe.dispatch.type", dispatch,
              "--dry-run"])  # fmt: skip
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("rl: error: [trainer.model.moe.dispatch] type = "), err
    assert err.count("\n") == 1 and needs in err and 'use type = "torch"' in err
    assert not out.exists()  # no config written, nothing launched


def test_an_expert_precision_that_cannot_run_is_one_line_exit_2_before_anything_starts(tmp_path, capsys):
    """`[trainer.model.moe.compute] type = "mxfp8"` is not wired in: refused before inference or torchrun start."""
    from prime_rl.launcher.rl import main

    model_dir = make_tiny_model(tmp_path / "moe", kind="qwen3_moe", dtype="float32")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["--model.name", str(model_dir), "--output-dir", str(out), "--trainer.model.moe.compute.type", "mxfp8",
              "--dry-run"])  # fmt: skip
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith('rl: error: [trainer.model.moe.compute] type = "mxfp8"'), err
    assert err.count("\n") == 1 and 'use type = "bf16"' in err
    assert not out.exists()
