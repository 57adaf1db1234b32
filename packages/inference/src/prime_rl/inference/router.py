"""Several independent servers on one node behind one ``vllm-router`` endpoint (``[router] replicas > 1``).

Replica ``i`` is a full ``inference`` process (its own engine, HTTP port ``server.port + 1 + i``, control
port ``control_port + i``, and on GPUs its own slice of CUDA_VISIBLE_DEVICES, ``dp * tp`` GPUs each).
The router on ``server.port`` spreads completions, chat and generate requests; with the default
``consistent_hash`` policy, requests carrying the same ``x-session-id`` header land on the same replica.

The router forwards unknown paths to one worker only, so weight updates never go through it: the
trainer / orchestrator sends control requests to every replica's control endpoint (see ``replica_endpoints``).

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

from prime_rl.common.config import write_toml
from prime_rl.common.config.inference import InferenceConfig


@dataclass(frozen=True)
class ReplicaEndpoints:
    url: str
    """HTTP base URL (``http://host:port``) of the replica's OpenAI-compatible API."""
    control: str
    """ZeroMQ control endpoint (``tcp://host:port``)."""


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def replica_endpoints(config: InferenceConfig) -> list[ReplicaEndpoints]:
    """Where each replica of ``config`` serves; send weight updates to every ``control`` endpoint."""
    host, control_host = _client_host(config.server.host), _client_host(config.server.control_host)
    control = config.server.resolved_control_port
    return [
        ReplicaEndpoints(f"http://{host}:{config.server.port + 1 + i}", f"tcp://{control_host}:{control + i}")
        for i in range(config.router.replicas)
    ]


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
    if not gpus:
        return [None] * config.router.replicas
    needed = per_replica * config.router.replicas
    if needed > len(gpus):
        raise RouterSetupError(
            f"router.replicas={config.router.replicas} x (dp {config.vllm.data_parallel_size} x tp "
            f"{config.vllm.tensor_parallel_size}) needs {needed} GPUs but {len(gpus)} are visible; "
            "lower router.replicas or the per-replica parallelism"
        )
    return [",".join(gpus[i * per_replica : (i + 1) * per_replica]) for i in range(config.router.replicas)]


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
    metrics_port = config.router.metrics_port or config.server.resolved_control_port + config.router.replicas
    return [
        exe,
        "--host",
        config.server.host,
        "--port",
        str(config.server.port),
        "--policy",
        config.router.policy,
        # vllm-router's metrics listener has a fixed default port; two routers on a node would collide.
        "--prometheus-host",
        _client_host(config.server.host),
        "--prometheus-port",
        str(metrics_port),
        "--worker-urls",
        *urls,
    ]


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
        single = config.model_copy(update={"router": config.router.model_copy(update={"replicas": 1})})
        write_toml(single, base)
        return _supervise(config, base, slices, exe, prog)


def _supervise(config: InferenceConfig, base: Path, slices: list[str | None], exe: str, prog: str) -> int:
    endpoints = replica_endpoints(config)
    control = config.server.resolved_control_port
    procs: list[subprocess.Popen] = []
    stopping = False

    def on_signal(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for i, gpus in enumerate(slices):
            env = dict(os.environ)
            if gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpus
            cmd = [sys.executable, "-m", "prime_rl.inference.entrypoint", "@", str(base)]
            cmd += ["--server.port", str(config.server.port + 1 + i), "--server.control-port", str(control + i)]
            procs.append(subprocess.Popen(cmd, env=env))
        try:
            _wait_healthy([e.url for e in endpoints], procs, config.router.startup_timeout)
        except (RuntimeError, TimeoutError) as e:
            sys.stderr.write(f"{prog}: error: {e}\n")
            return 1
        procs.append(subprocess.Popen(_router_command(config, [e.url for e in endpoints], exe)))
        print(
            f"router on http://{_client_host(config.server.host)}:{config.server.port}; control endpoints: "
            + " ".join(e.control for e in endpoints),
            flush=True,
        )
        while not stopping:
            for proc in procs:
                if proc.poll() is not None:
                    return proc.returncode or 1
            time.sleep(0.5)
        return 0
    finally:
        _stop(procs)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
