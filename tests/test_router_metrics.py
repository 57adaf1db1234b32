"""Rollout concurrency behind vllm-router: the router answers /metrics with one replica's text (it proxies the
request like any other), so the load limit reads every replica through `[orchestrator.model.client] metrics_urls`
and sums them. Two stand-in replicas serve distinct vLLM gauges; the real router binary sits in front."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from prime_rl.common.net import free_port
from prime_rl.orchestrator.client import InferenceClient
from prime_rl.orchestrator.concurrency import ServerLoad, total_load

ROUTER = Path(sys.executable).parent / "vllm-router"


def _replica(waiting: int, generated: int) -> ThreadingHTTPServer:
    text = f"vllm:num_requests_waiting {waiting}.0\nvllm:num_requests_running 8.0\nvllm:generation_tokens_total {generated}.0\n"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = text.encode() if self.path == "/metrics" else b'{"object": "list", "data": []}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def test_metrics_urls_sum_the_replicas_the_router_shows_one():
    if not ROUTER.exists():
        pytest.skip("needs vllm-router (prime-rl-inference)")
    replicas = [_replica(1, 100), _replica(2, 300)]
    urls = [f"http://127.0.0.1:{httpd.server_address[1]}" for httpd in replicas]
    port, metrics_port = free_port(), free_port()
    router = subprocess.Popen(
        [str(ROUTER), "--worker-urls", *urls, "--host", "127.0.0.1", "--port", str(port),
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert router.poll() is None, "vllm-router exited"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "vllm-router did not answer /health in 60 s"
            time.sleep(0.2)

        async def read() -> tuple[list[str] | None, list[str] | None]:
            behind = InferenceClient(f"http://127.0.0.1:{port}/v1", "m")
            summed = InferenceClient(f"http://127.0.0.1:{port}/v1", "m", metrics_urls=urls)
            try:
                return await behind.metrics_texts(), await summed.metrics_texts()
            finally:
                await behind.aclose()
                await summed.aclose()

        behind, summed = asyncio.run(read())
    finally:
        router.terminate()
        router.wait(timeout=30)
        for httpd in replicas:
            httpd.shutdown()
    one = total_load(behind)
    assert one is not None and one.generated in (100.0, 300.0)  # one replica's, as if it were all of them
    assert total_load(summed) == ServerLoad(waiting=3.0, running=16.0, kv_usage=None, generated=400.0, preempted=None)
