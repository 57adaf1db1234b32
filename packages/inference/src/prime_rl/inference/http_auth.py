"""The API key guards every HTTP route of an inference server, not only vLLM's guarded prefixes.

vLLM's ``--api-key`` checks the Bearer token on ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` (0.32)
only: ``/tokenize``, ``/detokenize``, ``/invocations`` (generation, SageMaker style), ``/pooling``,
``/score`` and the rest answered anyone (probe: ``/tokenize`` without the key). ``guard_every_route``
adds ``GuardEveryRoute`` to the app through vLLM's own ``--middleware`` option, so the server module keeps
no app code.

Decided open (``OPEN_PATHS``), as in vLLM: ``/health`` and ``/ping`` (liveness: what readiness probes and
the router's health checks call, and they carry no key) and ``/metrics`` (Prometheus counters and gauges:
load and throughput, no model access and no text; scrapers seldom carry a key). Every other path, an
unknown one included, needs ``Authorization: Bearer <key>``; CORS preflights (OPTIONS) pass as in vLLM.

The key travels to the middleware in ``HTTP_API_KEY_ENV`` (Starlette builds middleware with no arguments, and
vLLM may build the app in API-server processes of its own, which inherit the environment).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from prime_rl.common.env import HTTP_API_KEY_ENV

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})
"""Paths that answer without the key (liveness and Prometheus metrics; see the module docstring)."""
MIDDLEWARE = f"{__name__}.GuardEveryRoute"


def guard_every_route(args: argparse.Namespace) -> None:
    """Make every route but ``OPEN_PATHS`` need ``args.api_key`` (a no-op without a key)."""
    keys = [key for key in (args.api_key or [os.environ.get("VLLM_API_KEY")]) if key]
    if not keys:
        return
    os.environ[HTTP_API_KEY_ENV] = keys[0]
    args.middleware = [*(args.middleware or []), MIDDLEWARE]


class GuardEveryRoute:
    """ASGI middleware: 401 for a request without the Bearer key in ``HTTP_API_KEY_ENV``, except ``OPEN_PATHS``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        key = os.environ.get(HTTP_API_KEY_ENV)
        self._digest = None if not key else hashlib.sha256(key.encode()).digest()

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self._digest is not None
            and scope["type"] in ("http", "websocket")
            and scope.get("method") != "OPTIONS"
            and scope["path"].removeprefix(scope.get("root_path", "")) not in OPEN_PATHS
            and not self._authorized(scope)
        ):
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)
