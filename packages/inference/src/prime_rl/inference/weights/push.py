"""The push transports (nccl, nixl, ipc) in the API process: the control requests the trainer sends, per
``prime_rl.common.weight_transports.TRANSPORTS`` (set-up once, then begin + await per version).

Set-up (``InitBroadcastRequest`` / ``InitNixlRequest`` / ``InitIpcRequest``) runs in every worker under the
update lock (``set_up_workers``). A version's first request is validated here (the manifest, the version rule of the table), then
answered at once while a task receives it in the workers (``apply_update`` with ``prime_receive_broadcast`` /
``prime_receive_nixl`` / ``prime_receive_ipc``, which call ``prime_rl.inference.weights.broadcast_receiver`` /
``nixl_receiver`` / ``ipc_receiver``; nccl and ipc share ``begin_streamed``),
so the trainer may start sending; ``AwaitWeightsRequest`` answers when that task ends. The lock is held
from the first request until the task ends: updates never interleave.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from prime_rl.common.weight_transports import refuse_version
from prime_rl.common.wire import (
    AwaitWeightsRequest,
    BroadcastWeightsRequest,
    ControlReply,
    InitBroadcastRequest,
    InitIpcRequest,
    InitNixlRequest,
    IpcWeightsRequest,
    Message,
    NixlWeightsRequest,
    encode,
)
from prime_rl.inference.weights.apply import RestoreFailed, apply_update
from prime_rl.inference.weights.manifest import STILL_SERVED, WeightUpdateError

if TYPE_CHECKING:
    from prime_rl.inference.control import Controller

logger = logging.getLogger(__name__)


async def set_up_workers(controller: Controller, method: str, args: tuple[Any, ...]) -> list[Any]:
    """A push transport's once-per-session set-up: run ``method`` in every worker and return their results.
    Under the update lock, so a session's receivers are never rebuilt while an update uses them."""
    async with controller._lock:
        return await controller.engine.collective_rpc(method, args=args)


# -- nccl (gloo on CPU) ----------------------------------------------------------------------


async def init_broadcast(controller: Controller, request: InitBroadcastRequest) -> ControlReply:
    """Every worker joins the trainer's broadcast group as rank ``rank_offset`` + its global index."""
    if request.backend not in ("gloo", "nccl"):
        return controller._reply(
            False, f"backend {request.backend!r} is not supported; use 'nccl' (GPU) or 'gloo' (CPU)"
        )
    results = await set_up_workers(
        controller,
        "prime_init_broadcast",
        (
            request.host,
            request.port,
            request.world_size,
            request.rank_offset,
            request.backend,
            controller.broadcast_timeout_s,
            request.keep_rollback_copy,
        ),
    )
    logger.info("joined weight-broadcast group at %s:%d as %s", request.host, request.port, results)
    return controller._reply(True)


async def begin_broadcast(controller: Controller, request: BroadcastWeightsRequest) -> ControlReply:
    """Validate the layout, then receive it in a task; answered before any data moves."""
    return await begin_streamed(controller, request, "nccl", "prime_receive_broadcast", "broadcast")


async def begin_streamed(
    controller: Controller, request: BroadcastWeightsRequest | IpcWeightsRequest, transport: str, method: str, what: str
) -> ControlReply:
    """The first request of a version streamed bucket by bucket into the workers (nccl, ipc): validate the
    layout against the manifest and the table's version rule, then run ``method`` in the workers in a task
    (holding the update lock until it ends); answered before any data moves."""
    if request.version in controller._broadcasts:
        return controller._reply(False, f"a {what} of version {request.version} is already in progress")
    if (refusal := refuse_version(transport, request.version, controller.weight_version)) is not None:
        return controller._reply(False, refusal)
    if (refusal := asleep_weights(controller, request.version)) is not None:
        return controller._reply(False, refusal)
    source = f"{what} of version {request.version}"
    names = controller.manifest.check_transfer(
        request.specs, request.buckets, request.offsets, request.bucket_sizes, source
    )
    await controller._lock.acquire()  # released when the receive task ends
    # A worker without a copy of the previous streamed update (the first one, or keep_rollback_copy = false)
    # leaves a failed update partial; the weights on disk that serve now (if any) are then reloaded.
    restore, served = controller._restore_path, controller.weight_version

    async def receive() -> list[dict]:
        try:
            results = await apply_update(
                controller,
                request.version,
                method,
                names,
                [s.dtype for s in request.specs],
                [list(s.shape) for s in request.specs],
                request.buckets,
                request.offsets,
                request.bucket_sizes,
                request.version,
                served,
                restore_path=restore,
            )
        except RestoreFailed as e:
            raise WeightUpdateError(f"{source} failed ({e.__cause__}); {e}") from e
        except Exception as e:
            error = f"{source} failed: {e}"
            if restore is not None and STILL_SERVED not in str(e):
                error += f"; version {served} from {restore} {STILL_SERVED}"
            raise WeightUpdateError(error) from e
        finally:
            controller._lock.release()
        controller._restore_path = None  # streamed weights exist nowhere on disk (the workers keep a copy)
        return results

    controller._broadcasts[request.version] = asyncio.create_task(receive())
    # Give the collective_rpc a moment to reach the workers before the trainer starts sending;
    # not needed for correctness (the collective waits for both sides), it keeps the logs in order.
    await asyncio.sleep(0)
    return controller._reply(True)


def asleep_weights(controller: Controller, version: int) -> str | None:
    """Why a push of ``version`` cannot land now: the weights sleep (colocated runs), so the workers have no
    buffers to write into (level 1 keeps them in host memory, level 2 dropped them); None when awake."""
    state = controller.sleep_state
    if "weights" in state.awake:
        return None
    return (
        f"version {version} cannot be pushed while the weights sleep (level {state.level}, put to sleep by "
        f"{state.by}); send WakeUpRequest(tags=['weights']) first; version {controller.weight_version} serves on"
    )


async def await_update(controller: Controller, request: AwaitWeightsRequest) -> ControlReply:
    """Wait for the update task of ``version`` (either push transport) and say what serves now."""
    task = controller._broadcasts.pop(request.version, None)
    if task is None:
        return controller._reply(False, f"no broadcast of version {request.version} was started on this server")
    start = time.perf_counter()
    try:
        results = await task
    except WeightUpdateError as e:  # already says what happened to the served weights
        logger.error("update to version %d failed: %s", request.version, e)
        # Health fails only when what serves is not a version the server can name (partial weights).
        controller.failure = "" if STILL_SERVED in str(e) else str(e)
        return controller._reply(False, str(e))
    except Exception as e:
        logger.exception("update to version %d failed", request.version)
        controller.failure = (
            f"update to version {request.version} failed in the workers: {type(e).__name__}: {e}; "
            "the weights may be partially updated, send a full update again"
        )
        return controller._reply(False, controller.failure)
    controller.failure = ""
    # benchmarks/rl_system.py reads the workers' statistics and the engine's steps from this line (awaited_s: how
    # long this request waited for the update; the rest of the trainer's wait is the round trip)
    awaited = round(time.perf_counter() - start, 4)
    logger.info(
        "received weights version %d pushed by the trainer: %s; engine %s",
        request.version, results, {**controller.last_update_s, "awaited_s": awaited},
    )  # fmt: skip
    return controller._reply(True)


# -- nixl ------------------------------------------------------------------------------------


async def init_nixl(controller: Controller, request: InitNixlRequest) -> ControlReply:
    """Check the session's layout against the manifest, then build every worker's receiver."""
    from prime_rl.inference.weights.nixl_control import check_nixl_layout

    # Validate the session's layout here, before any worker allocates or registers anything.
    await asyncio.to_thread(check_nixl_layout, controller.manifest, request)
    results = await set_up_workers(
        controller,
        "prime_init_nixl",
        (
            request.host,
            request.port,
            request.session,
            request.rank_offset,
            request.keep_rollback_copy,
            request.timeout_s,
        ),
    )
    logger.info("NIXL receivers ready for session %s: %s", request.session, results)
    return controller._reply(True)


async def begin_nixl(controller: Controller, request: NixlWeightsRequest) -> ControlReply:
    """Refuse a version the table's rule refuses, then pull it in a task; answered before any data moves."""
    if request.version in controller._broadcasts:
        return controller._reply(False, f"an update to version {request.version} is already in progress")
    if (refusal := refuse_version("nixl", request.version, controller.weight_version)) is not None:
        return controller._reply(False, refusal)
    if (refusal := asleep_weights(controller, request.version)) is not None:
        return controller._reply(False, refusal)
    await controller._lock.acquire()  # released when the receive task ends
    controller._restore_path = None  # NIXL keeps its own rollback copy; nothing on disk holds these weights

    async def receive() -> list[dict]:
        try:
            return await apply_update(controller, request.version, "prime_receive_nixl", request.version)
        except Exception as e:
            # The worker's message says whether the old weights are still served (or rolled back).
            raise WeightUpdateError(f"NIXL update to version {request.version} failed: {e}") from e
        finally:
            controller._lock.release()

    controller._broadcasts[request.version] = asyncio.create_task(receive())
    await asyncio.sleep(0)
    return controller._reply(True)


# -- ipc -------------------------------------------------------------------------------------


async def init_ipc(controller: Controller, request: InitIpcRequest) -> ControlReply:
    """Every worker opens the trainer's shared slots and registers on its bucket channel."""
    if request.memory not in ("host", "device"):
        return controller._reply(False, f"IPC memory {request.memory!r} is not one of 'host', 'device'")
    # encoded: vLLM's own serializer of RPC arguments flattens array-like structs into lists
    results = await set_up_workers(controller, "prime_init_ipc", (encode(request),))
    logger.info("opened IPC session %s (%s memory): %s", request.session, request.memory, results)
    return controller._reply(True)


async def begin_ipc(controller: Controller, request: IpcWeightsRequest) -> ControlReply:
    """Validate the layout, then load it from the slots in a task; answered before the trainer fills them."""
    return await begin_streamed(controller, request, "ipc", "prime_receive_ipc", "IPC update")


HANDLERS: dict[type[Message], Callable[[Controller, Any], Awaitable[ControlReply]]] = {
    InitBroadcastRequest: init_broadcast,
    BroadcastWeightsRequest: begin_broadcast,
    AwaitWeightsRequest: await_update,
    InitNixlRequest: init_nixl,
    NixlWeightsRequest: begin_nixl,
    InitIpcRequest: init_ipc,
    IpcWeightsRequest: begin_ipc,
}
"""The push transports' control requests -> their handlers here (``handler(controller, request)``); kept beside
the handlers so a push request is added in one module (``control.WEIGHT_UPDATES`` adds the filesystem load)."""
