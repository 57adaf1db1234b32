"""Several independent servers on one node behind one ``vllm-router`` endpoint (``[router] replicas > 1``).

Replica ``i`` is a full ``inference`` process (its own engine, HTTP port ``server.port + 1 + i``, control
port ``control_port + i``, and on GPUs its own slice of CUDA_VISIBLE_DEVICES, ``dp * tp`` GPUs each).
The router on ``server.port`` spreads completions, chat and generate requests; with the default
``consistent_hash`` policy, requests carrying the same ``x-session-id`` header land on the same replica.

The router forwards unknown paths to one worker only, so weight updates never go through it: the
trainer / orchestrator sends control requests to every replica's control endpoint (see ``replica_endpoints``).

With ``[deployment] type = "disaggregated"`` the same supervisor starts ``num_prefill`` prefill and
``num_decode`` decode instances (instance ``k``, prefill first, on the replicas' ports), each with its KV
connector in its role (``--deployment.role``), and runs the router in P/D mode
(``--vllm-pd-disaggregation``): a request is sent to a prefill instance with ``max_tokens = 1``, then to a
decode instance, which loads the prompt's KV through the connector instead of recomputing it (vLLM's
disaggregated-prefill proxy, in Rust). ExampleConnector (vLLM's file-based reference connector) moves KV
through files: without a ``shared_storage_path`` it gets a directory here, removed when the router stops.

This process supervises: when any child exits, the others are stopped and its exit code returned.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from prime_rl.common import commands
from prime_rl.common.config import write_toml
from prime_rl.common.config.deployment import NIXL_CONNECTORS
from prime_rl.common.config.inference import InferenceConfig
from prime_rl.common.env import HEARTBEAT_DIR_ENV
from prime_rl.inference.replica_restarts import ReplicaRestarts


@dataclass(frozen=True)
class ReplicaEndpoints:
    url: str
    """HTTP base URL (``http://host:port``) of the replica's OpenAI-compatible API."""
    control: str
    """ZeroMQ control endpoint (``tcp://host:port``)."""


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def replica_endpoints(config: InferenceConfig) -> list[ReplicaEndpoints]:
    """Where each replica (or P/D instance, prefill first) of ``config`` serves; send weight updates to
    every ``control`` endpoint."""
    host, control_host = _client_host(config.server.host), _client_host(config.server.control_host)
    return [
        ReplicaEndpoints(f"http://{host}:{port}", f"tcp://{control_host}:{control}")
        for port, control in zip(config.instance_http_ports, config.instance_control_ports, strict=True)
    ]


def instance_roles(config: InferenceConfig) -> list[str | None]:
    """The P/D role of each instance (prefill first), or None for every plain replica."""
    pd = config.disaggregated
    if pd is None:
        return [None] * config.num_instances
    return ["prefill"] * pd.num_prefill + ["decode"] * pd.num_decode


def _gpu_slices(config: InferenceConfig) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each replica; None everywhere on a machine without GPUs."""
    per_replica = config.vllm.data_parallel_size * config.vllm.tensor_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [g for g in visible.split(",") if g.strip()]
    else:
        try:
            import torch

            gpus = [str(i) for i in range(torch.cuda.device_count())]
        except ImportError:
            gpus = []
    count = config.num_instances
    if not gpus:
        return [None] * count
    needed = per_replica * count
    if needed > len(gpus):
        what = (
            f"deployment.num_prefill + num_decode = {count}"
            if config.disaggregated is not None
            else f"router.replicas={count}"
        )
        raise RouterSetupError(
            f"{what} x (dp {config.vllm.data_parallel_size} x tp {config.vllm.tensor_parallel_size}) needs "
            f"{needed} GPUs but {len(gpus)} are visible; lower the instance count or the per-instance parallelism"
        )
    return [",".join(gpus[i * per_replica : (i + 1) * per_replica]) for i in range(count)]


class RouterSetupError(Exception):
    """The replicas cannot be started as configured (one line, exit 2)."""


def router_executable() -> str:
    """The vllm-router script (next to this interpreter, or on PATH); checked before any replica starts."""
    beside = Path(sys.executable).with_name("vllm-router")
    exe = str(beside) if beside.exists() else shutil.which("vllm-router")
    if exe is None:
        raise RouterSetupError(
            f"router.replicas > 1 needs vllm-router, which is not installed (not next to {sys.executable} nor on "
            "PATH); pip install 'prime-rl-inference[router]', or set router.replicas = 1"
        )
    return exe


def _router_command(config: InferenceConfig, urls: list[str], exe: str) -> list[str]:
    metrics_port = config.router.metrics_port or config.server.resolved_control_port + config.num_instances
    pd = config.disaggregated is not None
    return commands.router_command(
        exe, commands.router_pd_workers(instance_roles(config), urls) if pd else urls,
        config.server.host, config.server.port, _client_host(config.server.host), metrics_port,
        disaggregated=pd, policy=config.router.policy,
    )  # fmt: skip


def _wait_healthy(urls: list[str], procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = set(urls)
    while pending:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"replica (pid {proc.pid}) exited with {proc.returncode} during start-up")
        for url in list(pending):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    pending.discard(url)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"replicas {sorted(pending)} not healthy after {timeout_s}s; see their logs")
        time.sleep(1.0)


def replica_heartbeat_dir(i: int) -> Path | None:
    """Where replica ``i`` beats (``<run heartbeats>/inference-replica<i>``), None outside a launched run.

    Used with per-replica restarts only. Not at the launcher's own directory level: the launcher restarts the whole
    `inference` component on a stall it reads there, while one replica's stall (its engine errored, a wedged engine)
    is this supervisor's to restart alone (`ReplicaRestarts`)."""
    root = os.environ.get(HEARTBEAT_DIR_ENV)
    return Path(root) / f"inference-replica{i}" if root else None


def _replica_restarts(config: InferenceConfig, urls: list[str], spawn) -> ReplicaRestarts:
    """Restarts of one replica at a time behind the router (`inference.max_restarts`, replica_restarts.py)."""
    from prime_rl.common.readmission import control_version, http_healthy
    from prime_rl.common.restarts import RestartPolicy

    controls = [e.control for e in replica_endpoints(config)]  # probed with the run secret from the environment
    router_url = f"http://{_client_host(config.server.host)}:{config.server.port}"
    return ReplicaRestarts(
        urls, router_url, spawn, RestartPolicy(config.max_restarts, config.restart_window),
        startup_timeout_s=config.router.startup_timeout, healthy=lambda i: http_healthy(urls[i]),
        version=lambda i: control_version(controls[i]), beats=replica_heartbeat_dir,
    )  # fmt: skip


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + 60
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_replicas(config: InferenceConfig, prog: str = "inference") -> int:
    """Start the replicas, wait until they serve, start the router, supervise; return an exit code.

    What can be checked first is (the router's executable, the GPU count): a missing vllm-router is one
    line and exit 2 before any engine starts, not a traceback after every replica is up.
    """
    try:
        exe = router_executable()
        slices = _gpu_slices(config)
    except RouterSetupError as e:
        sys.stderr.write(f"{prog}: error: {e}\n")
        return 2
    with tempfile.TemporaryDirectory(prefix="prime-rl-inference-") as tmp:  # removed whatever happens
        base = Path(tmp) / "replica.toml"
        write_toml(_instance_base(config, Path(tmp)), base)
        return _supervise(config, base, slices, exe, prog)


def _instance_base(config: InferenceConfig, tmp: Path) -> InferenceConfig:
    """The config every instance starts from (its port, control port and P/D role come as flags)."""
    pd = config.disaggregated
    if pd is None:
        return config.model_copy(update={"router": config.router.model_copy(update={"replicas": 1})})
    extra = dict(pd.kv_connector_extra_config)
    if pd.kv_connector == "ExampleConnector" and "shared_storage_path" not in extra:
        (tmp / "kv").mkdir()  # not vLLM's default /tmp: another run's files of the same prompt would be loaded
        extra["shared_storage_path"] = str(tmp / "kv")
    return config.model_copy(update={"deployment": pd.model_copy(update={"kv_connector_extra_config": extra})})


NIXL_SIDE_CHANNEL_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"


def _side_channel_env(config: InferenceConfig, index: int) -> dict[str, str]:
    """NIXL's side channel (its KV handshake) listens on VLLM_NIXL_SIDE_CHANNEL_PORT + the engine's data-parallel
    rank: instances on one host need ports that far apart, or the second one cannot bind. Unless the environment
    sets a base, it follows this deployment's own ports (after the router's metrics port, itself after the control
    ports), so two deployments side by side on different ports do not collide on vLLM's fixed default (5600)."""
    pd = config.disaggregated
    if pd is None or pd.kv_connector not in NIXL_CONNECTORS:
        return {}
    default = config.server.resolved_control_port + config.num_instances + 1
    base = int(os.environ.get(NIXL_SIDE_CHANNEL_PORT, default))
    return {NIXL_SIDE_CHANNEL_PORT: str(base + index * config.vllm.data_parallel_size)}


def _supervise(config: InferenceConfig, base: Path, slices: list[str | None], exe: str, prog: str) -> int:
    endpoints = replica_endpoints(config)
    procs: list[subprocess.Popen] = []
    stopping = False

    def on_signal(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    restarts_enabled = config.max_restarts > 0 and config.disaggregated is None

    def spawn(i: int) -> subprocess.Popen:
        gpus, role = slices[i], instance_roles(config)[i]
        env = dict(os.environ)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        port, control = config.instance_http_ports[i], config.instance_control_ports[i]
        if restarts_enabled and (beats := replica_heartbeat_dir(i)):  # its own: every replica beats as inference-0
            env[HEARTBEAT_DIR_ENV] = str(beats)
        cmd = commands.inference_replica_command(sys.executable, base, port, control, role)
        if role is not None:
            env.update(_side_channel_env(config, i))
        print(
            f"instance {i}{f' ({role})' if role else ''}: {endpoints[i].url} on {f'GPUs {gpus}' if gpus else 'CPU'}",
            flush=True,
        )
        # a group of its own when it may be restarted: what a dead replica left behind is stopped with it
        return subprocess.Popen(cmd, env=env, start_new_session=restarts_enabled)

    try:
        procs.extend(spawn(i) for i in range(config.num_instances))
        try:
            _wait_healthy([e.url for e in endpoints], procs, config.router.startup_timeout)
        except (RuntimeError, TimeoutError) as e:
            sys.stderr.write(f"{prog}: error: {e}\n")
            return 1
        procs.append(subprocess.Popen(_router_command(config, [e.url for e in endpoints], exe)))
        roles = instance_roles(config)
        print(
            f"router on http://{_client_host(config.server.host)}:{config.server.port}"
            + (" (P/D: prefill then decode)" if config.disaggregated is not None else "")
            + "; control endpoints: "
            + " ".join(e.control + (f" ({r})" if r else "") for e, r in zip(endpoints, roles, strict=True)),
            flush=True,
        )
        restarts = _replica_restarts(config, [e.url for e in endpoints], spawn) if restarts_enabled else None
        replicas, router = procs[:-1], procs[-1]
        while not stopping:
            if restarts is not None:
                if (verdict := restarts.check(replicas)) is not None:
                    sys.stderr.write(f"{prog}: error: {restarts.reason}\n")
                    return verdict
                procs[:-1] = replicas
            for proc in procs if restarts is None else [router]:
                if proc.poll() is not None:
                    return proc.returncode or 1
            time.sleep(0.5)
        return 0
    finally:
        _stop(procs)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
