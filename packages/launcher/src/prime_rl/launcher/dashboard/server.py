"""`dashboard PATH`: a local web page plotting every run under PATH side by side, live.

Design: a stdlib `ThreadingHTTPServer` serves one Jinja2 page, the vendored uPlot files (no network
and no build step at run time) and a JSON endpoint `/api/state` that the page polls; each poll
reads only the bytes appended to each run's metrics file since the last one (see `registry`).
Left out: authentication and TLS - it binds to 127.0.0.1 by default; reach a remote cluster's
runs through an SSH tunnel (`ssh -L 8050:127.0.0.1:8050 host`).
"""

from __future__ import annotations

import argparse
import json
import sys
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import jinja2

from prime_rl.launcher.dashboard.registry import KEY_FIGURES, RunRegistry

HERE = Path(__file__).resolve().parent
STATIC_DIR = HERE / "static"
CONTENT_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".html": "text/html; charset=utf-8",
    ".LICENSE": "text/plain; charset=utf-8",
}
# Metrics plotted when the page opens, if the runs log them (every other key is one click away).
DEFAULT_PLOTS = [
    "reward/mean",
    "loss/mean",
    "perf/throughput",
    "perf/mfu",
    "perf/peak_memory",
    "mismatch_kl",
    "time/step",
]


def render_index(root: Path, poll_ms: int) -> bytes:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=jinja2.select_autoescape(["html", "j2"])
    )
    page = env.get_template("index.html.j2").render(
        root=str(root),
        config={"pollMs": poll_ms, "defaultPlots": DEFAULT_PLOTS, "figures": list(KEY_FIGURES)},
    )
    return page.encode()


def make_handler(registry: RunRegistry, index_html: bytes, quiet: bool) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            url = urlsplit(self.path)
            if url.path in ("/", "/index.html"):
                self._send(HTTPStatus.OK, index_html, CONTENT_TYPES[".html"])
            elif url.path == "/api/state":
                self._api_state(parse_qs(url.query).get("since", [""])[0])
            elif url.path.startswith("/static/"):
                self._static(url.path.removeprefix("/static/"))
            else:
                self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")

        def _api_state(self, since_raw: str) -> None:
            try:
                since = json.loads(since_raw) if since_raw else {}
                if not isinstance(since, dict):
                    raise ValueError("not an object")
            except ValueError as e:
                msg = f'since={since_raw!r} is not a JSON object ({e}); send {{"run": [epoch, rows]}}'
                self._send(HTTPStatus.BAD_REQUEST, msg.encode(), "text/plain")
                return
            body = json.dumps(registry.snapshot(since), separators=(",", ":")).encode()
            self._send(HTTPStatus.OK, body, "application/json", cache=False)

        def _static(self, name: str) -> None:
            # Only plain file names inside static/: no "..", no sub-folders.
            path = STATIC_DIR / name
            if "/" in name or name.startswith(".") or not path.is_file():
                self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
                return
            ctype = CONTENT_TYPES.get(path.suffix, "application/octet-stream")
            self._send(HTTPStatus.OK, path.read_bytes(), ctype, cache=True)

        def _send(self, status: HTTPStatus, body: bytes, ctype: str, cache: bool = False) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "max-age=3600" if cache else "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            if not quiet:
                super().log_message(format, *args)

    return Handler


def build_server(
    root: Path,
    host: str = "127.0.0.1",
    port: int = 8050,
    poll_ms: int = 2000,
    stale_after_s: float = 300.0,
    quiet: bool = True,
) -> ThreadingHTTPServer:
    """A ready-to-serve dashboard (port 0 picks a free port: read `server.server_address`)."""
    registry = RunRegistry(Path(root), stale_after_s=stale_after_s)
    handler = make_handler(registry, render_index(Path(root), poll_ms), quiet)
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="dashboard",
        description=__doc__.splitlines()[0],
        epilog="A run is any folder under PATH holding monitors/ or logs/latest. Status: logs/latest/STATUS "
        '({"state": ...}) if present; else failed if a log in logs/latest (or its trainer/torchrun/) shows a '
        "traceback, an ERROR line or a non-zero exit code; finished if a log says training/run finished; "
        "running if anything was written within --stale-after seconds; else stale.",
    )
    p.add_argument("path", type=Path, help="folder searched (any depth) for runs: <run>/monitors/file/metrics.jsonl")
    p.add_argument("--port", type=int, default=8050, help="TCP port to serve on (0 = any free port)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; 0.0.0.0 exposes it to the network")
    p.add_argument("--poll-ms", type=int, default=2000, help="how often the page asks for new data, in ms")
    p.add_argument(
        "--stale-after", type=float, default=300.0, help="seconds without writes before a run counts as stale"
    )
    p.add_argument("--verbose", action="store_true", help="log every HTTP request")
    args = p.parse_args(argv)
    if not args.path.is_dir():
        p.error(f"PATH={str(args.path)!r} is not a folder; pass the folder holding your runs (e.g. outputs/)")
    if args.poll_ms < 100:
        p.error(f"--poll-ms={args.poll_ms} is below 100; polling faster only burns CPU")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        server = build_server(args.path, args.host, args.port, args.poll_ms, args.stale_after, quiet=not args.verbose)
    except OSError as e:
        sys.exit(f"dashboard: cannot listen on {args.host}:{args.port} ({e.strerror}); pick another with --port")
    host, port = server.server_address[:2]
    print(f"dashboard: {args.path.resolve()} at http://{host}:{port}/  (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
