"""When a restarted replica may serve behind the router again, and the router calls that take it out and back.

Two supervisors restart one replica behind a vllm-router while the others serve: the replica supervisor of
`prime_rl.inference.router` (several replicas on one machine, `prime_rl.inference.replica_restarts`) and the SLURM
job script (one replica per inference node, `prime_rl.launcher.slurm.restarts`). The launcher may not import the
inference package, hence common.

Design:
- A restarted replica serves the model's own weights until the orchestrator reloads the policy into it
  (`prime_rl.orchestrator.heal`), and a request routed to it before would be tagged with a version it does not
  serve. So it is re-admitted only once its HTTP health answers and its control plane reports the version the
  serving replicas report (the newest of them: mid-update they may differ).
- Unless no other replica serves: when every other replica is restarting too (or there is none), the orchestrator
  holds every request until all answer (no replica serves the policy), so nothing can be tagged wrongly, and it
  needs the router to list the replica again before its health probe through the router passes. Then answering is
  enough. A replica outside a restart that does not answer is not "not serving": it may be busy loading.
- The probes use the standard library (urllib) and the run's control transport only: common has no HTTP client.
"""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Collection

from prime_rl.common.transport import ControlClient
from prime_rl.common.wire import HealthReply, HealthRequest


def readmission_version(
    i: int,
    num_replicas: int,
    restarting: Collection[int],
    healthy: Callable[[int], bool],
    version: Callable[[int], int | None],
) -> int | None:
    """The weight version replica ``i`` (restarting) serves once it may be put back behind the router, else None.

    ``restarting``: the replicas in a restart (``i`` among them); ``healthy`` / ``version`` probe one replica."""
    if not healthy(i) or (own := version(i)) is None:
        return None
    others = [j for j in range(num_replicas) if j != i and j not in restarting]
    if not others:  # no replica serves: the orchestrator holds every request until this one is back
        return own
    known = [v for j in others if (v := version(j)) is not None]
    return own if known and own == max(known) else None


def http_healthy(url: str, timeout_s: float = 2.0) -> bool:
    """``url``'s ``/health`` answers 200 (open without the API key)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, ValueError):  # URLError, HTTPError, refused, timed out
        return False


def control_version(address: str, timeout_s: float = 2.0) -> int | None:
    """The weight version a server's control plane reports (the run secret from the environment); None when it
    does not answer or is not ok."""
    try:
        with ControlClient(address, timeout_s=timeout_s) as client:
            reply = client.request(HealthRequest())
    except (TimeoutError, OSError):
        return None
    return reply.weight_version if isinstance(reply, HealthReply) and reply.ok else None


def router_worker(router_url: str, action: str, worker_url: str, api_key: str | None = None) -> str | None:
    """vllm-router's ``POST /<action>_worker?url=<worker_url>`` (``action``: add or remove); None when it answered
    200, else what went wrong (for the caller's log line)."""
    if action not in ("add", "remove"):
        raise ValueError(f"action={action!r} must be 'add' or 'remove'")
    query = urllib.parse.urlencode({"url": worker_url})
    request = urllib.request.Request(f"{router_url}/{action}_worker?{query}", data=b"", method="POST")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return None if response.status == 200 else f"answered {response.status}"
    except urllib.error.HTTPError as e:
        return f"answered {e.code}: {e.read(500).decode(errors='replace')}"
    except (OSError, ValueError) as e:
        return f"failed: {e}"
