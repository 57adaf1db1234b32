"""Start a real ``inference @ infer.toml`` subprocess on a small model, on CPU (vLLM starts in ~25 s),
and wait until its control plane and HTTP server answer. Used by the inference tests' shared server and
by the weight-transfer benchmarks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from prime_rl.common import commands
from prime_rl.common.net import free_port_range
from prime_rl.common.transport import ControlClient
from prime_rl.common.wire import HealthReply, HealthRequest

STARTUP_TIMEOUT_S = 240


def cpu_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
    return env


class Server:
    def __init__(self, model_dir: Path, port: int, control_port: int, proc: subprocess.Popen, log: Path) -> None:
        self.model_dir = model_dir
        self.url = f"http://127.0.0.1:{port}"
        self.control = f"tcp://127.0.0.1:{control_port}"
        self.proc = proc
        self.log = log

    def client(self, timeout_s: float = 120.0) -> ControlClient:
        return ControlClient(self.control, timeout_s=timeout_s)

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def write_config(
    path: Path,
    model_dir: Path,
    port: int,
    control_port: int,
    extra: str = "",
    max_model_len: int = 256,
    dtype: str = "float32",
) -> Path:
    """A test inference config; `extra` is TOML appended inside its [vllm] table (keys, or further tables)."""
    path.write_text(
        f"""
[model]
name = "{model_dir}"
[server]
host = "127.0.0.1"
port = {port}
control_host = "127.0.0.1"
control_port = {control_port}
[vllm]
enforce_eager = true
dtype = "{dtype}"
max_model_len = {max_model_len}
max_num_seqs = 16
{extra}
"""
    )
    return path


def wait_ready(server: Server, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"inference server exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            with ControlClient(server.control, timeout_s=2.0) as c:
                reply = c.request(HealthRequest())
            if isinstance(reply, HealthReply) and reply.ok and httpx.get(f"{server.url}/health").status_code == 200:
                return
        except (TimeoutError, httpx.HTTPError):
            time.sleep(1.0)
    raise RuntimeError(f"inference server not ready after {timeout_s}s:\n{server.log_tail()}")


def start_server(
    tmp: Path, model_dir: Path, extra: str = "", max_model_len: int = 256, dtype: str = "float32"
) -> Server:
    """A vLLM server for `model_dir` on free ports (config and log under `tmp`), ready; stop with stop_server.
    On CPU unless CUDA is visible (then on the first GPU, with `extra` setting its gpu_memory_utilization)."""
    # Below the ephemeral range (32768+ on Linux): an ephemeral port picked here was taken before vLLM bound it
    # (~25 s later) by an outgoing connection or vLLM's own bind-to-0 sockets ('Address already in use' in CI).
    port = free_port_range(2, 1024, 5000)
    control_port = port + 1
    config = write_config(tmp / "infer.toml", model_dir, port, control_port, extra, max_model_len, dtype)
    log = tmp / "server.log"
    proc = subprocess.Popen(
        commands.inference_command(sys.executable, config),
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        env=cpu_env(),
        start_new_session=True,
    )
    server = Server(model_dir, port, control_port, proc, log)
    try:
        wait_ready(server)
    except Exception:
        stop_server(proc)
        raise
    return server


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()  # SIGTERM: vLLM shuts its engine processes down
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # our own session only (start_new_session=True)
            proc.wait()


def server_logprobs(server: Server, ids: list[int]) -> list[float]:
    """logprob of token i+1 given tokens <= i, from the server's ``prompt_logprobs``: what the served
    weights compute, to compare against a reference or against the same call before an update."""
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": str(server.model_dir), "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0},
        timeout=60,
    )
    r.raise_for_status()
    entries = r.json()["choices"][0]["prompt_logprobs"][1:]
    return [entry[str(tok)]["logprob"] for entry, tok in zip(entries, ids[1:], strict=True)]
