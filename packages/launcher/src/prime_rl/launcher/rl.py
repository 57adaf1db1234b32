"""`rl @ rl.toml`: validate the whole run (no torch import), write the resolved configs, then run
inference, orchestrator and a torchrun trainer on this node as one supervised job, or hand the job to
SLURM when the config has a `[slurm]` table.

Placement: GPUs come from CUDA_VISIBLE_DEVICES (or every GPU nvidia-smi lists) in order: the first
`num_infer_gpus` to inference, the next `num_train_gpus` to the trainer; a colocated deployment gives both
the first `num_gpus` (`prime_rl.launcher.colocate`). Without GPUs every process
runs on the CPU and the trainer runs `num_train_gpus` gloo processes.

Ports: the ports users set (`inference.server.port`, its control port) are kept; the internal ones
nobody set (the orchestrator's batch ports, the weight announcements, the broadcast group) are reserved
at launch above the ephemeral range and locked for the launcher's lifetime, and torchrun's store binds
port 0 itself, so two runs side by side need only different inference ports and run names. The reservation
(and the served dtype, the resume step) is gathered by `prime_rl.launcher.host_facts.gather_local`; the configs
written are what the pure `prime_rl.launcher.resolution.resolve` makes of the config and those facts.

Closed control plane: the launcher writes the run secret (`<run_dir>/control.secret`, 0600) and hands
it to every process through PRIME_RL_SECRET_FILE, so every ZeroMQ socket of the run (control, batches,
weight announcements, NIXL metadata) authenticates with it (`prime_rl.common.auth`). Inference is
ready only when its control plane answers, over that secret, with this run's id: a server left over
from another run on the same port is never mistaken for ours.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from prime_rl.common import commands
from prime_rl.common.auth import SECRET_FILE_NAME, RunSecret
from prime_rl.common.config import ConfigError, ConfigWarning, parse_config, write_toml
from prime_rl.common.config.deployment import (
    GPU_CONTEXT_BYTES,
    ColocatedDeployment,
    SingleNodeDeployment,
    unknown_kv_connector,
)
from prime_rl.common.config.layout import LayoutError, check_layout, read_model_shape
from prime_rl.common.config.rl import RLConfig
from prime_rl.common.dispatch_kernels import exit_if_moe_kernels_missing
from prime_rl.common.env import (
    HEARTBEAT_DIR_ENV,
    SECRET_FILE_ENV,
    STALL_TIMEOUT_ENV,
    STDOUT_IS_LOG_ENV,
    TRAINER_LOG_DIR_ENV,
)
from prime_rl.common.rundir import RunDir
from prime_rl.common.vllm_compat import installed_vllm_version, sleep_mode_available, unsupported_reason
from prime_rl.common.weight_checksum import safetensors_layout
from prime_rl.launcher.colocate import fit_error, sleep_error
from prime_rl.launcher.dashboard.status import settle_dead_status, write_status
from prime_rl.launcher.host_facts import HostFacts, gather_local
from prime_rl.launcher.resolution import ResolvedRun, resolve

if TYPE_CHECKING:
    from prime_rl.launcher.supervisor import Component

log = logging.getLogger("prime_rl.launcher")


class PlacementError(ValueError):
    pass


def visible_gpus() -> list[str]:
    """GPU ids this launcher may use: CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists, else none."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True)
    return out.stdout.split() if out.returncode == 0 else []


def place(deployment: SingleNodeDeployment | ColocatedDeployment, gpus: list[str]) -> tuple[list[str], list[str]]:
    """(inference GPUs, trainer GPUs); both empty on a machine without GPUs. With ``num_infer_gpus = 0`` on a
    GPU machine, inference starts on the trainer's GPUs and shares them (see ``shared_gpu_warning``); a
    colocated deployment gives both sides the same ``num_gpus`` GPUs."""
    if not gpus:
        return [], []
    if isinstance(deployment, ColocatedDeployment):
        if deployment.num_gpus > len(gpus):
            raise PlacementError(
                f"deployment.num_gpus={deployment.num_gpus} but {len(gpus)} GPUs are visible ({','.join(gpus)}); "
                "lower deployment.num_gpus or set CUDA_VISIBLE_DEVICES"
            )
        shared = gpus[: deployment.num_gpus]
        return shared, list(shared)
    need = deployment.num_infer_gpus + deployment.num_train_gpus
    if need > len(gpus):
        raise PlacementError(
            f"deployment asks for {deployment.num_infer_gpus} inference + {deployment.num_train_gpus} trainer GPUs "
            f"= {need}, but {len(gpus)} are visible ({','.join(gpus)}); lower num_infer_gpus/num_train_gpus or "
            "set CUDA_VISIBLE_DEVICES"
        )
    train = gpus[deployment.num_infer_gpus : need]
    return (gpus[: deployment.num_infer_gpus] or train), train


TRAINER_FLOOR_BYTES = GPU_CONTEXT_BYTES
"""Memory a trainer needs beyond its bf16 weights and gradients (CUDA context, activations of one chunk)."""


def shared_gpu_check(gpu_memory_utilization: float, gpu_bytes: int | None, num_params: int | None) -> str | None:
    """On a GPU that vLLM shares with the trainer: the one-line error when vLLM's share leaves the trainer
    less than it needs even with `offload = "full"` (bf16 weights + gradients, 4 bytes a parameter), else None."""
    if gpu_bytes is None or num_params is None:
        return None
    left = (1.0 - gpu_memory_utilization) * gpu_bytes
    need = 4 * num_params + TRAINER_FLOOR_BYTES
    if left >= need:
        return None
    most = max(0.0, 1.0 - need / gpu_bytes)
    return (
        f"inference.vllm.gpu_memory_utilization={gpu_memory_utilization} leaves the trainer {left / 2**30:.1f} GiB of "
        f"the shared {gpu_bytes / 2**30:.0f} GiB GPU, below the {need / 2**30:.1f} GiB it needs even with "
        f'trainer.model.offload = "full"; set it to at most {math.floor(most * 100) / 100:.2f}, or give inference '
        "its own GPUs with deployment.num_infer_gpus"
    )


def check_shared_gpus(cfg: RLConfig, gpus: list[str]) -> None:
    """Inference on the trainer's GPUs (``num_infer_gpus = 0``): say so, and refuse a vLLM share that leaves
    the trainer no room. Both sides keep their memory all the time and take turns on the GPU."""
    util = cfg.inference.vllm.gpu_memory_utilization
    log.warning(
        "deployment.num_infer_gpus=0: inference shares GPU %s with the trainer (vLLM takes %.0f%% of it and keeps it); "
        "give inference its own GPUs with deployment.num_infer_gpus, or see the colocated mode in docs/DESIGN.md",
        ",".join(gpus), util * 100,
    )  # fmt: skip
    error = shared_gpu_check(util, gpu_memory_bytes(gpus[0]), checkpoint_params(Path(cfg.trainer.model.name)))
    if error is not None:
        raise ConfigError(error, keys=["inference.vllm.gpu_memory_utilization"])


def check_colocated(cfg: RLConfig, gpus: list[str], facts: HostFacts) -> HostFacts:
    """A colocated run on this machine: refuse a vLLM that cannot sleep and a model that cannot fit (ConfigError,
    one line); returns ``facts`` with the GPU's memory and the model's size, which size vLLM's share."""
    assert isinstance(cfg.deployment, ColocatedDeployment)
    error = sleep_error(sleep_mode_available(), bool(gpus), installed_vllm_version())
    if error is not None:
        raise ConfigError(error, keys=["deployment.type"])
    gpu_bytes = gpu_memory_bytes(gpus[0]) if gpus else None
    num_params = checkpoint_params(Path(cfg.trainer.model.name))
    if gpu_bytes is not None and num_params is not None:
        tp = cfg.inference.vllm.tensor_parallel_size
        if (error := fit_error(gpu_bytes, num_params, cfg.deployment.num_gpus, tp)) is not None:
            raise ConfigError(error, keys=["deployment.num_gpus"])
    log.info(
        "colocated: inference and trainer take turns on %s",
        f"GPU {','.join(gpus)}" if gpus else "the CPU (nothing to free)",
    )
    return dataclasses.replace(facts, gpu_bytes=gpu_bytes, num_params=num_params)


def check_ipc_placement(cfg: RLConfig, train_gpus: list[str]) -> None:
    """`weight_broadcast.memory = "device"` shares CUDA buffers: it needs a trainer on GPUs (the config checked
    that inference shares them)."""
    wb = cfg.trainer.weight_broadcast
    if wb.type == "ipc" and wb.memory == "device" and not train_gpus:
        raise ConfigError(
            "weight_broadcast.memory='device' shares CUDA buffers, but no GPU is visible (the trainer and inference "
            "run on the CPU); set weight_broadcast.memory='host'",
            keys=["trainer.weight_broadcast.memory"],
        )


def gpu_memory_bytes(gpu: str) -> int | None:
    """Total memory of GPU ``gpu`` from nvidia-smi; None when it cannot be read."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "-i", gpu, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
        capture_output=True, text=True,
    )  # fmt: skip
    try:
        return int(out.stdout.split()[0]) * 2**20 if out.returncode == 0 else None
    except (IndexError, ValueError):
        return None


def checkpoint_params(model_dir: Path) -> int | None:
    """Parameters of a local checkpoint, from its safetensors headers; None when there are none."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    headers = [safetensors_layout(f)[1] for f in files]
    return sum(math.prod(t["shape"]) for h in headers for name, t in h.items() if name != "__metadata__")


def num_train_ranks(cfg: RLConfig) -> tuple[int, str]:
    """Trainer ranks of this run and the key that sets them."""
    if isinstance(cfg.deployment, ColocatedDeployment):
        return cfg.deployment.num_ranks, "deployment.num_gpus"  # x num_nodes: FSDP over every node's GPUs
    if isinstance(cfg.deployment, SingleNodeDeployment):
        return cfg.deployment.num_train_gpus, "deployment.num_train_gpus"
    return cfg.deployment.num_train_nodes * cfg.deployment.gpus_per_node, "deployment.num_train_nodes"


def check_run(cfg: RLConfig) -> None:
    """What can be known before anything starts (and at --dry-run): the model directory, the trainer's
    parallel layout against its ranks and the model's config.json. Raises ConfigError naming the keys."""
    model_dir = Path(cfg.trainer.model.name)
    if not (model_dir / "config.json").is_file():
        message = (
            f"model.name={cfg.trainer.model.name!r} is not a local Hugging Face model directory (no config.json); "
            "give a directory with config.json, *.safetensors and tokenizer files"
        )
        if cfg.slurm is None:
            raise ConfigError(message, keys=["trainer.model.name"])
        warnings.warn(f"{message} (not found here; it must exist on the cluster)", ConfigWarning, stacklevel=2)
    world, world_key = num_train_ranks(cfg)
    try:
        check_layout(cfg.trainer.model, world, read_model_shape(model_dir), "trainer.", world_key)
    except LayoutError as e:
        raise ConfigError(str(e), keys=e.keys) from None
    pd = cfg.inference.disaggregated
    if pd is not None and (error := unknown_kv_connector(pd, "inference.deployment.kv_connector")) is not None:
        raise ConfigError(error, keys=["inference.deployment.kv_connector"])


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def disk_needed(cfg: RLConfig) -> int:
    """Bytes this run's files will take at their peak, roughly: the kept trainer checkpoints (fp32 weights
    and two AdamW moments, 12 bytes a parameter, one more while the newest is written) and the kept
    weight broadcasts. Metrics and logs are small next to them."""
    model_dir = Path(cfg.trainer.model.name)
    params = 0
    for file in model_dir.glob("*.safetensors"):
        start, header = safetensors_layout(file)
        for name, info in header.items():
            if name != "__metadata__":
                params += math.prod(info["shape"])
    need = 0
    if cfg.trainer.ckpt.interval:
        kept = cfg.trainer.ckpt.keep_last or max(1, (cfg.trainer.max_steps or 1) // cfg.trainer.ckpt.interval)
        need += params * 12 * (kept + 1)
    wb = cfg.trainer.weight_broadcast
    if wb.type == "filesystem":
        need += params * _DTYPE_BYTES.get(str(wb.dtype), 4) * (wb.keep_last + 1)
    return need


def check_disk(cfg: RLConfig, path: Path) -> str | None:
    """A warning when the filesystem holding ``path`` has less free space than ``disk_needed``."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free, need = shutil.disk_usage(probe).free, disk_needed(cfg)
    if free >= need:
        return None
    return (
        f"{probe} has {free / 2**30:.1f} GiB free but this run's checkpoints (ckpt.keep_last="
        f"{cfg.trainer.ckpt.keep_last}) and weight broadcasts need about {need / 2**30:.1f} GiB; free space, "
        "lower ckpt.keep_last / ckpt.interval, or move output_dir (a full disk stops the run at the next save)"
    )


def write_configs(run: ResolvedRun, run_dir: RunDir) -> dict[str, Path]:
    """configs/rl.toml (the whole resolved run) and one config per process."""
    written = {"rl": write_toml(run.config, run_dir.config_path("rl"))}
    for name, config in run.process_configs().items():
        written[name] = write_toml(config, run_dir.config_path(name))
    return written


def _http_ok(url: str) -> bool:
    import urllib.request  # here, like the ZeroMQ imports below: `rl --help` and --dry-run never need them

    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def inference_ready(cfg: RLConfig, secret: RunSecret) -> bool:
    """HTTP health answers and every replica's control plane says it serves this run (its run id)."""
    from prime_rl.common.transport import ControlClient  # numpy + ZeroMQ: only once a run starts
    from prime_rl.common.wire import HealthReply, HealthRequest

    server = cfg.inference.server
    if not _http_ok(f"http://127.0.0.1:{server.port}/health"):
        return False
    for control in cfg.inference.instance_control_ports:  # every replica, or every P/D instance
        endpoint = f"tcp://127.0.0.1:{control}"
        try:
            with ControlClient(endpoint, timeout_s=2.0, secret=secret) as client:
                reply = client.request(HealthRequest())
        except TimeoutError:  # not up yet, or another run's server (its CURVE keys differ)
            return False
        if not isinstance(reply, HealthReply) or not reply.ok or reply.run_id != secret.run_id:
            if isinstance(reply, HealthReply) and reply.run_id != secret.run_id:
                log.warning("%s answers for run %r, not this run (%s)", endpoint, reply.run_id, secret.run_id)
            return False
    return True


def build_components(
    cfg: RLConfig, run_dir: RunDir, configs: dict[str, Path], infer_gpus, train_gpus, secret: RunSecret
) -> list[Component]:
    from prime_rl.launcher.supervisor import Component  # ctypes, signals: only once a run starts

    logs = run_dir.attempt_logs_dir()
    py = sys.executable
    gpu_env = lambda gpus: {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else {}  # noqa: E731
    nproc = cfg.deployment.num_train_gpus
    torchrun_log_dir = run_dir.trainer_log_dir()
    trainer_cmd = commands.torchrun_loopback_command(py, nproc, commands.RL_TRAINER, configs["trainer"])
    return [
        Component(
            "inference",
            commands.inference_command(py, configs["inference"]),
            logs / "inference.log",
            env=gpu_env(infer_gpus),
            ready=lambda: inference_ready(cfg, secret),
            ready_timeout_s=cfg.inference.router.startup_timeout,  # the deadline of this wait, from config
            max_restarts=cfg.inference.max_restarts,
            restart_window_s=cfg.inference.restart_window,
            alive=lambda: _http_ok(f"http://127.0.0.1:{cfg.inference.server.port}/health"),
            unhealthy_after_s=120.0,  # vLLM answers 503 once its engine is dead, then exits: this is for a wedged one
        ),
        Component(
            "orchestrator",
            commands.orchestrator_command(py, configs["orchestrator"]),
            logs / "orchestrator.log",
            env={STDOUT_IS_LOG_ENV: "1"},
            echo=True,
        ),
        Component(
            "trainer",
            trainer_cmd,
            logs / "trainer.log",
            env={**gpu_env(train_gpus), TRAINER_LOG_DIR_ENV: str(torchrun_log_dir), "OMP_NUM_THREADS": "1"}
            if train_gpus
            else {TRAINER_LOG_DIR_ENV: str(torchrun_log_dir), "CUDA_VISIBLE_DEVICES": ""},
            finishes_run=True,
            echo=True,
        ),
    ]


def submit_slurm(run_dir: RunDir, configs: dict[str, Path], dry_run: bool) -> int:
    argv = ["@", configs["rl"], *(["--dry-run"] if dry_run else [])]
    return subprocess.call(commands.slurm_command(sys.executable, "rl", argv))


class StoppedBeforeStart(SystemExit):
    """SIGINT / SIGTERM while the launcher was still building its processes (code 128 + the signal)."""


def _stopped_before_start(signum: int, _frame) -> None:
    raise StoppedBeforeStart(128 + signum)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [launcher] %(message)s", datefmt="%H:%M:%S")
    cfg = parse_config(RLConfig, argv, prog="rl", check=check_run)
    run_dir = RunDir(cfg.output_dir, cfg.run.name)
    if cfg.slurm is not None:  # handed over as it is: the SLURM job resolves it (`gather_slurm`)
        configs = {"rl": write_toml(cfg, run_dir.config_path("rl"))}
        for name in ("trainer", "orchestrator", "inference"):
            configs[name] = write_toml(getattr(cfg, name), run_dir.config_path(name))
        sys.exit(submit_slurm(run_dir, configs, cfg.dry_run))
    if not isinstance(cfg.deployment, SingleNodeDeployment | ColocatedDeployment):
        sys.stderr.write(
            "rl: error: deployment.type='multi_node' needs a [slurm] table (multi-node runs go through SLURM)\n"
        )
        sys.exit(2)
    # here, not in the SLURM job's submit step above: that host need not have the GPU nodes' kernels
    moe = cfg.trainer.model.moe
    exit_if_moe_kernels_missing(moe.dispatch.type, moe.compute.type, "rl", "trainer.model.moe")
    try:
        infer_gpus, train_gpus = place(cfg.deployment, visible_gpus())
        facts = gather_local(cfg, run_dir)
        if isinstance(cfg.deployment, ColocatedDeployment):
            facts = check_colocated(cfg, infer_gpus, facts)
        elif infer_gpus and infer_gpus == train_gpus:
            check_shared_gpus(cfg, infer_gpus)
        check_ipc_placement(cfg, train_gpus)
        run = resolve(cfg, facts)
    except ConfigError as e:
        sys.stderr.write(f"rl: error: {e}\n")
        sys.exit(2)
    except (PlacementError, FileNotFoundError) as e:
        sys.stderr.write(f"rl: error: {e}\n")
        sys.exit(2)
    configs = write_configs(run, run_dir)
    cfg, resume_step = run.config, run.resume_step  # from here on, the resolved run
    if cfg.dry_run:
        print(f"wrote {', '.join(str(p) for p in configs.values())}")
        return
    version = installed_vllm_version()  # read from the package metadata: the launcher never imports vLLM
    if version is not None and (reason := unsupported_reason(version)) is not None:
        sys.stderr.write(f"rl: error: {reason}\n")
        sys.exit(2)
    if dead := settle_dead_status(run_dir.latest_logs / "STATUS"):  # a SIGKILLed launcher wrote no final state
        log.warning("the previous attempt (%s) is marked failed: %s", run_dir.latest_logs.resolve().name, dead)
    from prime_rl.launcher.supervisor import Supervisor  # ctypes, signals: a run's, not --help's or --dry-run's

    run_dir.start_attempt()
    if (warning := check_disk(cfg, run_dir.root)) is not None:
        log.warning("%s", warning)
    # What a dead attempt left beyond the resume point must not be loaded (newer weights, newer or
    # half-written checkpoints): set aside before any component starts.
    for path in run_dir.discard_after(resume_step):
        log.warning("set aside %s: newer than the resume point (%s)", path, resume_step or "fresh start")
    log.info(
        "run %s: inference on GPU %s, trainer on GPU %s" if train_gpus else "run %s: inference on %s, trainer on %s",
        run_dir.root,
        ",".join(infer_gpus) or "CPU",
        ",".join(train_gpus) or "CPU",
    )
    secret = RunSecret.create(run_dir.root / SECRET_FILE_NAME)
    os.environ[SECRET_FILE_ENV] = str(run_dir.root / SECRET_FILE_NAME)  # inherited by every component
    heartbeat_dir = run_dir.root / "heartbeats"
    os.environ[HEARTBEAT_DIR_ENV] = str(heartbeat_dir)
    os.environ[STALL_TIMEOUT_ENV] = str(cfg.stall_timeout)
    # A stop signal before the supervisor takes the signals over ends the launcher the same way (exit 128 + n,
    # final STATUS): the default action killed it outright and left STATUS at "running".
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _stopped_before_start)
    write_status(run_dir.root, "running", pid=os.getpid(), host=socket.gethostname())  # restarts update it
    rc, reason = 1, "the launcher failed before the run ended"
    try:
        components = build_components(cfg, run_dir, configs, infer_gpus, train_gpus, secret)
        status = {"pid": os.getpid(), "host": socket.gethostname()}
        supervisor = Supervisor(
            components,
            heartbeat_dir=heartbeat_dir,
            # STATUS stays "running" through a restart and says so: the dashboard shows the last event
            on_restart=lambda event, n: write_status(run_dir.root, "running", **status, restarts=n, last_restart=event),
        )
        rc = supervisor.run()
        reason = "" if rc == 0 else supervisor.reason or f"exit code {rc}"
    except StoppedBeforeStart as e:
        rc, reason = e.code, f"stopped by {signal.Signals(e.code - 128).name} before the processes started"
    except BaseException as e:  # every exit path leaves a final STATUS, whatever ended the launcher
        reason = f"launcher error: {type(e).__name__}: {e}"
        raise
    finally:
        write_status(run_dir.root, "finished" if rc == 0 else "failed", reason=reason)
    sys.exit(rc)


if __name__ == "__main__":
    main()
