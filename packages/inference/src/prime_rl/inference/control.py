"""The control plane: wire requests (pause, resume, load, broadcast, health) turned into engine calls.

A ``ControlServer`` (ZeroMQ REP, ``prime_rl.common.transport``) runs in a thread and hands each request
to ``Controller.handle`` on the server's event loop, where the ``AsyncLLM`` lives. Every weight update:

1. is validated in this process against the served model's manifest (names, shapes, dtypes) -- a bad
   update is refused before any worker sees it and the old weights keep serving;
2. pauses generation unless the client already paused (``weights.pause_mode``, "keep" by default:
   in-flight requests are frozen, not lost);
3. runs inside every worker through ``collective_rpc`` (``PrimeWorkerExtension``), never restarting;
4. resets the prefix cache and preempts running requests, so no KV computed with old weights is reused;
5. sets the engine's weight version, which vLLM attaches to every token it generates from then on
   (``weight_versions`` spans in ``/inference/v1/generate`` responses);
6. resumes generation if step 2 paused it.

Updates are serialized by one lock. A broadcast is two requests: ``BroadcastWeightsRequest`` is
answered once the specs are validated and the workers wait for data (so the trainer may start sending),
``AwaitWeightsRequest`` once the weights are loaded.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from prime_rl.common.transport import ControlServer
from prime_rl.common.wire import (
    AwaitWeightsRequest,
    BroadcastWeightsRequest,
    ControlReply,
    HealthReply,
    HealthRequest,
    InitBroadcastRequest,
    InitNixlRequest,
    LoadWeightsRequest,
    Message,
    NixlWeightsRequest,
    PauseRequest,
    ResumeRequest,
)
from prime_rl.inference.weights.manifest import (
    ITEMSIZE,
    Manifest,
    Spec,
    WeightUpdateError,
    check_bucket_layout,
    check_checkpoint_dir,
)

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")


class Controller:
    """Applies control requests to one ``AsyncLLM`` (``engine``)."""

    def __init__(
        self,
        engine: Any,
        manifest: Manifest,
        *,
        model_name: str,
        pause_mode: str = "keep",
        marker: str = "STABLE",
        broadcast_timeout_s: float = 600.0,
    ) -> None:
        self.engine = engine
        self.manifest = manifest
        self.model_name = model_name
        self.pause_mode = pause_mode
        self.marker = marker
        self.broadcast_timeout_s = broadcast_timeout_s
        self.weight_version = 0
        self._client_paused = False
        self._lock = asyncio.Lock()
        self._broadcasts: dict[int, asyncio.Task] = {}

    async def start(self) -> None:
        await self.engine.update_weight_version(str(self.weight_version))

    # -- dispatch ------------------------------------------------------------------------------

    async def handle(self, request: Message) -> Message:
        try:
            if isinstance(request, HealthRequest):
                return await self._health()
            if isinstance(request, PauseRequest):
                return await self._pause(request)
            if isinstance(request, ResumeRequest):
                return await self._resume()
            if isinstance(request, LoadWeightsRequest):
                return await self._load(request)
            if isinstance(request, InitBroadcastRequest):
                return await self._init_broadcast(request)
            if isinstance(request, BroadcastWeightsRequest):
                return await self._broadcast(request)
            if isinstance(request, AwaitWeightsRequest):
                return await self._await_broadcast(request)
            if isinstance(request, InitNixlRequest):
                return await self._init_nixl(request)
            if isinstance(request, NixlWeightsRequest):
                return await self._nixl(request)
        except WeightUpdateError as e:
            logger.error("%s", e)
            return self._reply(False, str(e))
        return self._reply(False, f"{type(request).__name__} is not a control request an inference server handles")

    def _reply(self, ok: bool, error: str | None = None) -> ControlReply:
        return ControlReply(ok=ok, error=error, weight_version=self.weight_version)

    # -- pause / resume / health ---------------------------------------------------------------

    async def _pause(self, request: PauseRequest) -> ControlReply:
        if request.mode not in PAUSE_MODES:
            return self._reply(False, f"pause mode {request.mode!r} is not one of {PAUSE_MODES}")
        await self.engine.pause_generation(mode=request.mode)
        self._client_paused = True
        return self._reply(True)

    async def _resume(self) -> ControlReply:
        async with self._lock:  # never resume in the middle of an update
            await self.engine.resume_generation()
            self._client_paused = False
        return self._reply(True)

    async def _health(self) -> HealthReply:
        return HealthReply(
            ok=not self.engine.errored,
            weight_version=self.weight_version,
            paused=await self.engine.is_paused(),
            model=self.model_name,
        )

    # -- weight updates ------------------------------------------------------------------------

    async def _apply(self, version: int, method: str, *args: Any) -> list[dict]:
        """Pause if needed, run ``method`` in every worker, invalidate caches, tag the version, resume."""
        paused_here = not self._client_paused
        if paused_here:
            await self.engine.pause_generation(mode=self.pause_mode)
        try:
            results = await self.engine.collective_rpc(method, args=args)
            # Preempt running requests too: their KV was computed with the old weights.
            await self.engine.reset_prefix_cache(reset_running_requests=True)
            await self.engine.update_weight_version(str(version))
            self.weight_version = version
        finally:
            if paused_here:
                await self.engine.resume_generation()
        return results

    async def _load(self, request: LoadWeightsRequest) -> ControlReply:
        specs = check_checkpoint_dir(request.path, self.marker)
        self.manifest.check(specs, source=request.path)
        async with self._lock:
            results = await self._apply(request.version, "prime_load_checkpoint", str(request.path))
        logger.info("loaded weights version %d from %s: %s", request.version, request.path, results)
        return self._reply(True)

    async def _init_broadcast(self, request: InitBroadcastRequest) -> ControlReply:
        if request.backend not in ("gloo", "nccl"):
            return self._reply(False, f"backend {request.backend!r} is not supported; use 'nccl' (GPU) or 'gloo' (CPU)")
        async with self._lock:
            results = await self.engine.collective_rpc(
                "prime_init_broadcast",
                args=(
                    request.host,
                    request.port,
                    request.world_size,
                    request.rank_offset,
                    request.backend,
                    self.broadcast_timeout_s,
                ),
            )
        logger.info("joined weight-broadcast group at %s:%d as %s", request.host, request.port, results)
        return self._reply(True)

    async def _broadcast(self, request: BroadcastWeightsRequest) -> ControlReply:
        if request.version in self._broadcasts:
            return self._reply(False, f"a broadcast of version {request.version} is already in progress")
        for spec in request.specs:
            if spec.dtype not in ITEMSIZE:
                raise WeightUpdateError(f"tensor {spec.name} has unsupported dtype {spec.dtype!r}")
        specs = {s.name: Spec(s.dtype, tuple(s.shape)) for s in request.specs}
        names = [s.name for s in request.specs]
        check_bucket_layout(names, [specs[n] for n in names], request.buckets, request.offsets, request.bucket_sizes)
        self.manifest.check(specs, source=f"broadcast of version {request.version}")
        await self._lock.acquire()  # released when the receive task ends

        async def receive() -> list[dict]:
            try:
                return await self._apply(
                    request.version,
                    "prime_receive_broadcast",
                    names,
                    [s.dtype for s in request.specs],
                    [list(s.shape) for s in request.specs],
                    request.buckets,
                    request.offsets,
                    request.bucket_sizes,
                )
            finally:
                self._lock.release()

        self._broadcasts[request.version] = asyncio.create_task(receive())
        # Give the collective_rpc a moment to reach the workers before the trainer starts sending;
        # not needed for correctness (the collective waits for both sides), it keeps the logs in order.
        await asyncio.sleep(0)
        return self._reply(True)

    async def _await_broadcast(self, request: AwaitWeightsRequest) -> ControlReply:
        task = self._broadcasts.pop(request.version, None)
        if task is None:
            return self._reply(False, f"no broadcast of version {request.version} was started on this server")
        try:
            results = await task
        except WeightUpdateError as e:  # already says what happened to the served weights
            logger.error("update to version %d failed: %s", request.version, e)
            return self._reply(False, str(e))
        except Exception as e:
            logger.exception("broadcast of version %d failed", request.version)
            return self._reply(
                False,
                f"broadcast of version {request.version} failed in the workers: {type(e).__name__}: {e}; "
                "the weights may be partially updated, send a full update again",
            )
        logger.info("received weights version %d by broadcast: %s", request.version, results)
        return self._reply(True)

    # -- nixl ------------------------------------------------------------------------------------

    async def _init_nixl(self, request: InitNixlRequest) -> ControlReply:
        from prime_rl.inference.weights.nixl_control import check_nixl_layout

        # Validate the session's layout here, before any worker allocates or registers anything.
        await asyncio.to_thread(check_nixl_layout, self.manifest, request)
        async with self._lock:
            results = await self.engine.collective_rpc(
                "prime_init_nixl",
                args=(
                    request.host,
                    request.port,
                    request.session,
                    request.rank_offset,
                    request.keep_rollback_copy,
                    request.timeout_s,
                ),
            )
        logger.info("NIXL receivers ready for session %s: %s", request.session, results)
        return self._reply(True)

    async def _nixl(self, request: NixlWeightsRequest) -> ControlReply:
        if request.version in self._broadcasts:
            return self._reply(False, f"an update to version {request.version} is already in progress")
        if request.version <= self.weight_version:
            return self._reply(
                False,
                f"refused NIXL update to version {request.version}: version {self.weight_version} is served and "
                "versions must increase",
            )
        await self._lock.acquire()  # released when the receive task ends

        async def receive() -> list[dict]:
            try:
                return await self._apply(request.version, "prime_receive_nixl", request.version)
            except Exception as e:
                # The worker's message says whether the old weights are still served (or rolled back).
                raise WeightUpdateError(f"NIXL update to version {request.version} failed: {e}") from e
            finally:
                self._lock.release()

        self._broadcasts[request.version] = asyncio.create_task(receive())
        await asyncio.sleep(0)
        return self._reply(True)


class ControlThread:
    """Runs a ``ControlServer`` in a thread and forwards each request to ``controller`` on ``loop``."""

    def __init__(self, endpoint: str, controller: Controller, loop: asyncio.AbstractEventLoop) -> None:
        self.server = ControlServer(endpoint)
        self.endpoint = self.server.endpoint
        self._controller = controller
        self._loop = loop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prime-rl-control", daemon=True)

    def _handle(self, request: Message, arrays: dict) -> Message:
        return asyncio.run_coroutine_threadsafe(self._controller.handle(request), self._loop).result()

    def _run(self) -> None:
        try:
            self.server.serve_forever(self._handle, self._stop)
        finally:
            self.server.close()

    def start(self) -> ControlThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
