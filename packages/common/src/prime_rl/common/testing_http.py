"""A stand-in HTTP server for tests: what a replica's health route or vllm-router's admin routes look like from
outside (``/health``; ``POST /add_worker?url=...``), without vLLM or the router."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def serve_http(
    port: int = 0, post: Callable[[BaseHTTPRequestHandler], int] | None = None, host: str = "127.0.0.1"
) -> ThreadingHTTPServer:
    """Serve on a daemon thread (port 0: any free one, ``server_address[1]``): ``GET /health`` answers 200, any
    other GET 404; a POST answers the status ``post(request)`` returns (200 without ``post``). Stop with
    ``shutdown()`` and ``server_close()``."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def do_POST(self) -> None:
            self.send_response(200 if post is None else post(self))
            self.end_headers()

    httpd = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd
