"""A filesystem update (``LoadWeightsRequest``) in the API process: check, verify, load, or restore.

The orchestrator drives it (``prime_rl.common.weight_transports``: the filesystem transport is loaded by the
orchestrator). The directory is checked against the manifest and read in full in a thread
(``weights.verify``) while the old weights serve; the workers then reload it (``apply_update``). If they fail,
the weights the server last loaded from disk are reloaded and health says whether that worked. A LoRA
adapter directory goes to ``prime_rl.inference.lora``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from prime_rl.common.wire import ControlReply, LoadWeightsRequest
from prime_rl.inference.lora import is_adapter_dir, load_adapter
from prime_rl.inference.weights.apply import RestoreFailed, apply_update
from prime_rl.inference.weights.manifest import check_checkpoint_dir
from prime_rl.inference.weights.verify import verify_weights_dir

if TYPE_CHECKING:
    from prime_rl.inference.control import Controller

logger = logging.getLogger(__name__)


async def load_checkpoint(controller: Controller, request: LoadWeightsRequest) -> ControlReply:
    """Serve the directory (or LoRA adapter) at ``request.path`` as ``request.version``."""
    if is_adapter_dir(request.path):  # a LoRA adapter: loaded by name over the base (prime_rl.inference.lora)
        return await load_adapter(controller, request)
    specs = check_checkpoint_dir(request.path, controller.marker)
    controller.manifest.check(specs, source=request.path)
    start = time.perf_counter()
    if controller.verify_data:
        # Off the event loop: serving continues while every byte is read.
        report = await asyncio.to_thread(verify_weights_dir, request.path)
        logger.info("verified %s: %s", request.path, report)
    verified = time.perf_counter()
    async with controller._lock:
        try:
            results = await apply_update(
                controller,
                request.version,
                "prime_load_checkpoint",
                str(request.path),
                restore_path=controller._restore_path,
            )
        except Exception as e:
            return _load_failed(controller, request, e)
    controller._restore_path = str(request.path)
    controller.failure = ""
    # benchmarks/rl_system.py reads these two durations (verify: serving goes on; load: paused)
    logger.info(
        "loaded weights version %d from %s: verify %.3f s, load %.3f s: %s",
        request.version, request.path, verified - start, time.perf_counter() - verified, results,
    )  # fmt: skip
    return controller._reply(True)


def _load_failed(controller: Controller, request: LoadWeightsRequest, error: Exception) -> ControlReply:
    """Reply to a load the workers failed; health stays failed unless the previous weights came back."""
    cause = error.__cause__ if isinstance(error, RestoreFailed) else error
    what = f"loading weights version {request.version} from {request.path} failed ({type(cause).__name__}: {cause})"
    if isinstance(error, RestoreFailed):
        controller.failure = f"{what}; {error}"
    elif controller._restore_path is None:
        controller.failure = f"{what}; no previous weights on disk to restore, the served weights may be partial"
    else:
        logger.warning("restored weights version %d from %s", controller.weight_version, controller._restore_path)
        return controller._reply(
            False, f"{what}; version {controller.weight_version} from {controller._restore_path} serves again"
        )
    logger.error("%s", controller.failure)
    return controller._reply(False, controller.failure)
