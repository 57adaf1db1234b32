"""Fixtures: a real, deterministic OpenAI-compatible HTTP server (vLLM's chat-completions flavour).

The server "tokenizes" the chat-templated prompt as UTF-8 bytes (token id = byte + 3) and answers
each of the `n` choices with a deterministic text derived from the last prompt line:
choice i is that line reversed with its first i characters dropped (so rewards differ within a
group), and the last choice of a group is the text "BOOM" when `boom_last` is set (tests use it
to make an environment raise). Token logprobs are -0.01 * (position + 1).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from prime_rl.common import net
from prime_rl.common.net import free_port
from prime_rl.common.transport import ControlServer
from prime_rl.common.wire import ControlReply, HealthReply, HealthRequest, LoadWeightsRequest

EOS = 2
OFFSET = 3


def encode(text: str) -> list[int]:
    return [b + OFFSET for b in text.encode("utf-8")]


class HTTPServer(ThreadingHTTPServer):
    """Python's default listen backlog is 5: a burst of concurrent requests (groups x teacher calls) overflows
    it and the client sees a reset connection (ReadError), a flaky test rather than a bug in the code."""

    request_queue_size = 256
    daemon_threads = True


def chat_template(messages: list[dict]) -> str:
    return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


class FakeOpenAIServer:
    def __init__(
        self,
        boom_last: bool = False,
        slow_requests: dict[int, float] | None = None,
        fail_first: int = 0,
        max_prompt_chars: int | None = None,
    ):
        self.boom_last = boom_last
        self.max_prompt_chars = max_prompt_chars  # longer prompts get vLLM's HTTP 400 "maximum context length"
        self.slow_requests = slow_requests or {}  # request index -> seconds to sleep first
        self.fail_first = fail_first  # answer the first k requests with HTTP 503
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server._lock:
                    index = len(server.requests)
                    server.requests.append(body)
                if index < server.fail_first:
                    return self._reply(503, {"error": "warming up"})
                if self.path != "/v1/chat/completions":
                    return self._reply(404, {"error": f"no route {self.path}"})
                prompt = chat_template(body["messages"])
                if server.max_prompt_chars is not None and len(prompt) > server.max_prompt_chars:
                    message = (
                        f"This model's maximum context length is {server.max_prompt_chars} tokens. However, your "
                        f"prompt contains {len(prompt)} input tokens, which exceeds this limit even without any "
                        "output tokens. Please reduce the length of the input prompt."
                    )  # vLLM 0.26-0.32's words (renderers/params.py)
                    return self._reply(400, {"error": {"message": message, "type": "BadRequestError", "code": 400}})
                time.sleep(server.slow_requests.get(index, 0.0))
                self._reply(200, server.respond(body))

            def _reply(self, status: int, payload: dict):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def respond(self, body: dict) -> dict:
        prompt = chat_template(body["messages"])
        source = body["messages"][-1]["content"].splitlines()[-1]
        n, max_tokens = body.get("n", 1), body["max_tokens"]
        choices = []
        for i in range(n):
            text = "BOOM" if self.boom_last and i == n - 1 and n > 1 else source[::-1][i:]
            ids = encode(text)[: max_tokens - 1] + [EOS]
            finish = "stop" if len(encode(text)) < max_tokens else "length"
            if finish == "length":
                ids = ids[:max_tokens]
            content = [{"token": f"token_id:{t}", "logprob": -0.01 * (j + 1)} for j, t in enumerate(ids)]
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": {"content": content},
                    "finish_reason": finish,
                    "token_ids": ids,
                }
            )
        return {"id": "chatcmpl-test", "object": "chat.completion", "model": body["model"],
                "choices": choices, "prompt_token_ids": encode(prompt)}  # fmt: skip

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def openai_server():
    with FakeOpenAIServer() as server:
        yield server


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    return free_port()


def free_port_range(n: int) -> int:
    """A base port with n consecutive free ports in 20000-31999, below Linux's ephemeral range (32768+) so that a
    ZeroMQ peer retrying a connect can never be handed the same port as its own source port."""
    return net.free_port_range(n, 20000, 32000)


@pytest.fixture
def make_server():
    """`make_server(boom_last=..., slow_requests=..., fail_first=...)` -> a started FakeOpenAIServer."""
    servers: list[FakeOpenAIServer] = []

    def make(**kwargs) -> FakeOpenAIServer:
        server = FakeOpenAIServer(**kwargs).__enter__()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.__exit__()


@pytest.fixture
def ports():
    """Helpers: ports.closed_port(), ports.free_port_range(n)."""

    class Ports:
        closed = staticmethod(closed_port)
        free_range = staticmethod(free_port_range)

    return Ports


class ControlPlane:
    """A real control server (ZeroMQ, the wire's messages) standing in for one inference server's: a load sets its
    version; ``die`` closes it, ``start`` brings it back as a restarted server (a new socket and boot id, the model's
    own weights: version 0)."""

    def __init__(self) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.requests: list[tuple[str, str]] = []
        """(request type, boot id of the process that answered it)"""
        self.version, self.stop = 0, None
        self.engine_dead = False
        """vLLM's engine core died under the API server, which still answers: every request with an error, health
        not ok (what `prime_rl.inference.control` does until vLLM exits)."""
        self.start()

    def start(self) -> None:
        self.boot_id, self.version, self.stop = uuid.uuid4().hex, 0, threading.Event()
        deadline = time.monotonic() + 10
        while True:  # the old socket's port is released a moment after it closes
            try:
                self.server = ControlServer(self.endpoint, secret=None)
                break
            except OSError:
                assert time.monotonic() < deadline, f"{self.endpoint} was not released"
                time.sleep(0.1)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(self._handle, self.stop, 0.01))
        self.thread.start()

    def _handle(self, message, arrays):
        self.requests.append((type(message).__name__, self.boot_id))
        if self.engine_dead:
            error = "EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause."
            if isinstance(message, HealthRequest):
                return HealthReply(ok=False, weight_version=self.version, boot_id=self.boot_id, error=error)
            return ControlReply(ok=False, weight_version=self.version, boot_id=self.boot_id, error=error)
        if isinstance(message, LoadWeightsRequest):
            self.version = message.version
        if isinstance(message, HealthRequest):
            return HealthReply(ok=True, weight_version=self.version, boot_id=self.boot_id)
        return ControlReply(ok=True, weight_version=self.version, boot_id=self.boot_id)

    def die(self) -> None:
        if self.stop is not None and not self.stop.is_set():
            self.stop.set()
            self.thread.join()
            self.server.close()

    def restart(self) -> None:
        self.die()
        self.start()


@pytest.fixture
def control_plane():
    """`control_plane()` -> a started ControlPlane, closed after the test."""
    planes: list[ControlPlane] = []

    def make() -> ControlPlane:
        planes.append(ControlPlane())
        return planes[-1]

    yield make
    for plane in planes:
        plane.die()
