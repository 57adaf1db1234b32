"""The API key guards every HTTP route but /health, /ping and /metrics (probe: /tokenize answered without it)."""

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from prime_rl.common.env import HTTP_API_KEY_ENV
from prime_rl.inference.http_auth import MIDDLEWARE, GuardEveryRoute

PATHS = ("/tokenize", "/detokenize", "/invocations", "/v1/models", "/health", "/ping", "/metrics", "/anything")


def _client(monkeypatch, key: str | None) -> TestClient:
    if key is None:
        monkeypatch.delenv(HTTP_API_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(HTTP_API_KEY_ENV, key)
    ok = lambda request: PlainTextResponse("ok")  # noqa: E731
    app = Starlette(routes=[Route(p, ok, methods=["GET", "POST", "OPTIONS"]) for p in PATHS])
    app.add_middleware(GuardEveryRoute)  # how vLLM's --middleware adds it: the class, no arguments
    return TestClient(app)


@pytest.mark.chaos
def test_every_route_but_liveness_and_metrics_needs_the_key(monkeypatch):
    client = _client(monkeypatch, "s3cret")
    for path in ("/tokenize", "/detokenize", "/invocations", "/v1/models", "/anything"):
        assert client.post(path, json={"prompt": "hi"}).status_code == 401, path
        assert client.post(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        assert client.post(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200, path
    for path in ("/health", "/ping", "/metrics"):
        assert client.get(path).status_code == 200, path
    assert client.options("/tokenize").status_code == 200  # CORS preflight, as vLLM lets it pass


def test_without_a_key_nothing_is_guarded(monkeypatch):
    assert _client(monkeypatch, None).post("/tokenize").status_code == 200


def test_vllm_builds_its_app_with_the_guard(monkeypatch):
    """Through the real path: build_vllm_args (server.api_key set) and vLLM's own build_app."""
    pytest.importorskip("vllm", reason="builds vLLM's app: needs the cpu or gpu extra")
    from vllm.entrypoints.launchers.app import build_app

    from prime_rl.common.config import load_config
    from prime_rl.common.config.inference import InferenceConfig
    from prime_rl.inference.server import build_vllm_args

    monkeypatch.delenv(HTTP_API_KEY_ENV, raising=False)
    cfg = load_config(InferenceConfig, ["--model.name", "m", "--server.host", "0.0.0.0", "--server.api-key", "k"])
    args = build_vllm_args(cfg)
    assert MIDDLEWARE in args.middleware
    client = TestClient(build_app(args, supported_tasks=("generate",)))
    assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 401
    assert client.post("/invocations", json={"prompt": "hi"}).status_code == 401
    assert client.get("/v1/models").status_code == 401  # vLLM's own guard, still there
