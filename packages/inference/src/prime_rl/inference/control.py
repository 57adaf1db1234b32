"""The control plane: wire requests (pause, resume, load, broadcast, health) turned into engine calls.

A ``ControlServer`` (ZeroMQ REP, ``prime_rl.common.transport``) runs in a thread and hands each request
to ``Controller.handle`` on the server's event loop, where the ``AsyncLLM`` lives. The controller holds the
server's state (served version, update lock, failure, client pause) and dispatches; pause, resume and health
are answered here, weight updates in ``prime_rl.inference.weights``. Every weight update:

1. is validated in this process against the served model's manifest (names, shapes, dtypes) -- a bad
   update is refused before any worker sees it and the old weights keep serving;
2. pauses generation unless the client already paused (``weights.pause_mode``, "keep" by default:
   in-flight requests are frozen, not lost);
3. runs inside every worker through ``collective_rpc`` (``PrimeWorkerExtension``), never restarting;
4. resets the prefix cache and preempts running requests, so no KV computed with old weights is reused;
5. sets the engine's weight version, which vLLM attaches to every token it generates from then on
   (``weight_versions`` spans in ``/inference/v1/generate`` responses);
6. resumes generation if step 2 paused it.

Steps 2-6 are ``weights.apply.apply_update``; step 1 and the rest of a transport's requests are
``weights.load`` (filesystem: ``LoadWeightsRequest``) and ``weights.push`` (nccl, nixl, ipc), per the table of
``prime_rl.common.weight_transports``.

Before step 2 a filesystem update is read in full in a thread (``weights.verify``: sizes, the trainer's
per-tensor checksums, finite values) while the old weights keep serving. If the workers still fail to
load it, the previous weights are reloaded from where they came from (the model directory or the last
good ``broadcasts/step_<n>``); health reports ``ok=False`` with the reason until an update succeeds.
Every pause, resume and weight update is logged with the peer address it came from.

Updates are serialized by one lock. A broadcast is two requests: ``BroadcastWeightsRequest`` is
answered once the specs are validated and the workers wait for data (so the trainer may start sending),
``AwaitWeightsRequest`` once the weights are loaded.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from prime_rl.common.heartbeat import Heartbeat
from prime_rl.common.rundir import BROADCAST_MARKER
from prime_rl.common.transport import ControlServer, ServerThread
from prime_rl.common.wire import (
    ControlReply,
    HealthReply,
    HealthRequest,
    LoadWeightsRequest,
    Message,
    PauseRequest,
    ResumeRequest,
    SleepRequest,
    WakeUpRequest,
)
from prime_rl.inference import sleep
from prime_rl.inference.weights import push
from prime_rl.inference.weights.load import load_checkpoint
from prime_rl.inference.weights.manifest import Manifest, WeightUpdateError

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")

WEIGHT_UPDATES: dict[type[Message], Callable[[Any, Any], Awaitable[ControlReply]]] = {
    LoadWeightsRequest: load_checkpoint,
    **push.HANDLERS,
}
"""Weight-update requests -> their handlers (``handler(controller, request)``): the filesystem transport's load
(``weights.load``) and the push transports' requests (``weights.push``); which transport sends which is the table
in ``prime_rl.common.weight_transports``."""


class Controller:
    """Applies control requests to one ``AsyncLLM`` (``engine``)."""

    def __init__(
        self,
        engine: Any,
        manifest: Manifest,
        *,
        model_name: str,
        pause_mode: str = "keep",
        marker: str = BROADCAST_MARKER,
        broadcast_timeout_s: float = 600.0,
        run_id: str = "",
        model_dir: str | None = None,
        verify_data: bool = True,
        weight_version_label: bool = True,
    ) -> None:
        self.engine = engine
        self.weight_version_label = weight_version_label
        """vLLM labels generated tokens with the served version (``vllm_compat``: not before 0.32)."""
        self.manifest = manifest
        self.model_name = model_name
        self.pause_mode = pause_mode
        self.marker = marker
        self.broadcast_timeout_s = broadcast_timeout_s
        self.weight_version = 0
        self.run_id = run_id
        self.verify_data = verify_data
        self.failure = ""
        """Why the served weights are not trustworthy ("" when they are); health reports it."""
        self._restore_path = model_dir  # where the served weights can be reloaded from
        self.paused_by = ""
        """Origin of the client pause in force ("" when generation is not client-paused)."""
        self._client_paused = False
        self._lock = asyncio.Lock()
        self._broadcasts: dict[int, asyncio.Task] = {}
        self.last_update_s: dict[str, float] = {}
        """The engine's steps of the last update (``weights.apply.apply_update``): pause, workers, reset_cache, ..."""
        self.sleep_state = sleep.SleepState.of(engine)
        """Colocated runs: what of the engine is awake (``prime_rl.inference.sleep``)."""
        self.boot_id = uuid.uuid4().hex[:16]
        """Sent with every reply: a client that sees it change knows this address now serves a restarted process
        (one that never got the updates the old one did), even when the restart fell between two of its requests."""

    async def start(self) -> None:
        await self.label_version(self.weight_version)

    async def label_version(self, version: int) -> None:
        """Tell vLLM which version serves, where it can label tokens with it (``/inference/v1/generate``)."""
        if self.weight_version_label:
            await self.engine.update_weight_version(str(version))

    # -- dispatch ------------------------------------------------------------------------------

    async def handle(self, request: Message, origin: str = "?") -> Message:
        """Carry out ``request``; ``origin`` (the peer address) is logged for every state change."""
        if not isinstance(request, HealthRequest):
            logger.info("control request %s from %s", _describe(request), origin)
        try:
            if isinstance(request, HealthRequest):
                return await self._health()
            if isinstance(request, PauseRequest):
                return await self._pause(request, origin)
            if isinstance(request, ResumeRequest):
                return await self._resume()
            if isinstance(request, SleepRequest):  # colocated runs: prime_rl.inference.sleep
                return await sleep.sleep(self, request, origin)
            if isinstance(request, WakeUpRequest):
                return await sleep.wake_up(self, request, origin)
            if update := WEIGHT_UPDATES.get(type(request)):
                return await update(self, request)
        except WeightUpdateError as e:  # refused before any worker saw it: the served weights are untouched
            error = f"{e}; the update is refused and version {self.weight_version} serves on"
            logger.error("%s", error)
            return self._reply(False, error)
        except Exception as e:  # a reply with the serving version, never the transport's bare traceback text
            logger.exception("%s from %s failed", type(request).__name__, origin)
            return self._reply(False, f"{type(request).__name__} failed: {type(e).__name__}: {e}")
        return self._reply(False, f"{type(request).__name__} is not a control request an inference server handles")

    def _reply(self, ok: bool, error: str | None = None) -> ControlReply:
        return ControlReply(ok=ok, error=error, weight_version=self.weight_version, boot_id=self.boot_id)

    # -- pause / resume / health ---------------------------------------------------------------

    async def _pause(self, request: PauseRequest, origin: str = "?") -> ControlReply:
        if request.mode not in PAUSE_MODES:
            return self._reply(False, f"pause mode {request.mode!r} is not one of {PAUSE_MODES}")
        await self.engine.pause_generation(mode=request.mode)
        self._client_paused = True
        self.paused_by = f"{request.by}@{origin}" if request.by else origin
        return self._reply(True)

    async def _resume(self) -> ControlReply:
        async with self._lock:  # never resume in the middle of an update
            if not self.sleep_state.sleeping:  # asleep: the wake-up resumes once everything is awake
                await self.engine.resume_generation()
            self._client_paused = False
            self.paused_by = ""
        return self._reply(True)

    async def _health(self) -> HealthReply:
        errored = bool(self.engine.errored)
        try:
            paused = await self.engine.is_paused()
        except Exception as e:  # the engine is shutting down or dead: an answer, not a traceback
            return HealthReply(
                ok=False, weight_version=self.weight_version, model=self.model_name, run_id=self.run_id,
                boot_id=self.boot_id, error=f"the engine does not answer ({type(e).__name__}: {e})",
            )  # fmt: skip
        sleeping = await sleep.is_sleeping(self)
        return HealthReply(
            ok=not errored and not self.failure,
            weight_version=self.weight_version,
            paused=paused,
            model=self.model_name,
            run_id=self.run_id,
            boot_id=self.boot_id,
            error="the engine has errored" if errored else self.failure,
            sleeping=sleeping,
            awake=self.sleep_state.awake_list(),
        )


async def beat_forever(
    controller: Controller, heartbeat: Heartbeat, max_pause_s: float, interval_s: float = 2.0, liveness_s: float = 60.0
) -> None:
    """Report the server's phase to the launcher's watchdog until cancelled.

    "serving" beats with progress every ``interval_s`` once the engine core has answered a probe (its
    pause state): an engine core that does not answer within ``liveness_s / 2`` (a stopped or wedged
    process) is reported overdue as such, a dead engine at once, a hung event loop after ``liveness_s``.
    Measured (CPU `rl` run, liveness 60 s): SIGSTOP of vLLM's EngineCore ended the run 32 s later, named
    "engine core not answering for 30s"; with the probe waiting the full 60 s it took 65 s and read as a
    stale "serving", hence the half. A client pause may last ``max_pause_s``
    (one that is never resumed froze a run silently); a weight update, ``broadcast_timeout_s`` (no probe
    then: the engine is busy reloading and would answer only afterwards).
    """
    while True:
        version = controller.weight_version
        if controller._lock.locked():
            heartbeat.beat("updating weights", version, deadline_s=controller.broadcast_timeout_s)
        # Half the liveness deadline: a stuck probe is then named as such before "serving" goes stale.
        elif (problem := await _probe_engine(controller, liveness_s / 2)) is not None:
            heartbeat.beat(problem, version, deadline_s=0.0)  # already overdue: the watchdog stops the run
        elif controller.paused_by:
            heartbeat.beat(f"paused by {controller.paused_by}", version, deadline_s=max_pause_s)
        else:
            heartbeat.beat("serving", version, deadline_s=liveness_s, progress=True)
        await asyncio.sleep(interval_s)


async def _probe_engine(controller: Controller, timeout_s: float) -> str | None:
    """None when the engine core answers within ``timeout_s``, else what is wrong with it."""
    if controller.engine.errored:
        return "engine errored"
    try:
        await asyncio.wait_for(controller.engine.is_paused(), timeout_s)
    except TimeoutError:
        return f"engine core not answering for {timeout_s:.0f}s"
    except Exception as e:
        return f"engine core failed ({type(e).__name__}: {e})"
    return None


def _describe(request: Message) -> str:
    if isinstance(request, LoadWeightsRequest):
        return f"LoadWeightsRequest(version={request.version}, path={request.path})"
    if isinstance(request, PauseRequest):
        return f"PauseRequest(mode={request.mode}" + (f", by={request.by})" if request.by else ")")
    if isinstance(request, SleepRequest | WakeUpRequest):
        return repr(request)
    version = getattr(request, "version", None)
    return type(request).__name__ + (f"(version={version})" if version is not None else "")


class ControlThread(ServerThread):
    """Runs a ``ControlServer`` in a thread and forwards each request to ``controller`` on ``loop``.

    The server authenticates with the run secret from the environment (``prime_rl.common.auth``); the
    controller reports that secret's run id in its health replies.
    """

    def __init__(self, endpoint: str, controller: Controller, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(ControlServer(endpoint), self._handle, "prime-rl-control")
        if self.server.secret is not None:
            controller.run_id = self.server.secret.run_id
        self._controller = controller
        self._loop = loop

    def _handle(self, request: Message, arrays: dict) -> Message:
        origin = self.server.last_origin
        return asyncio.run_coroutine_threadsafe(self._controller.handle(request, origin), self._loop).result()
