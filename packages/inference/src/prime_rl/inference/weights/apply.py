"""The one sequence every weight update runs in the engine, whatever the transport (the controller's step 2-6).

Pause unless the client already paused, run the transport's method in every worker (``collective_rpc``), drop
the KV computed with the old weights, tag the new version, resume. A failed method with a ``restore_path``
reloads the weights there before generation resumes, so a half-loaded model never serves a request.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prime_rl.inference.control import Controller

logger = logging.getLogger(__name__)


class RestoreFailed(RuntimeError):
    def __init__(self, path: str, error: Exception) -> None:
        super().__init__(f"restoring the previous weights from {path} failed too ({type(error).__name__}: {error})")


async def apply_update(
    controller: Controller, version: int, method: str, *args: Any, restore_path: str | None = None
) -> list[dict]:
    """Pause if needed, run ``method`` in every worker, invalidate caches, tag the version, resume.

    If ``method`` fails and ``restore_path`` is set, the weights there are reloaded before generation
    resumes (a half-loaded model never serves a request), then the original error is raised.
    """
    # Asleep (colocated, a push into the woken weights): sleep already stopped generation, and the wake-up of
    # the KV cache resumes it; resuming here would schedule requests on an engine without its KV cache.
    paused_here = not controller._client_paused and not controller.sleep_state.sleeping
    # seconds per step, logged with the update (controller.last_update_s): on the H200 the trainer waited 0.60 s
    # for a colocated 1.7B push whose workers took 0.13 s, and these say where the rest goes
    phases: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[f"{name}_s"] = round(now - clock, 4)
        clock = now

    if paused_here:
        await controller.engine.pause_generation(mode=controller.pause_mode)
        lap("pause")
    try:
        try:
            results = await controller.engine.collective_rpc(method, args=args)
            lap("workers")
        except Exception as e:
            if restore_path is None:
                raise
            logger.error("%s failed (%s: %s); restoring %s", method, type(e).__name__, e, restore_path)
            try:
                await controller.engine.collective_rpc("prime_load_checkpoint", args=(restore_path,))
            except Exception as restore_error:
                raise RestoreFailed(restore_path, restore_error) from e
            await controller.engine.reset_prefix_cache(reset_running_requests=True)
            raise
        # Preempt running requests too: their KV was computed with the old weights.
        await controller.engine.reset_prefix_cache(reset_running_requests=True)
        lap("reset_cache")
        await controller.label_version(version)
        lap("label")
        controller.weight_version = version
    finally:
        if paused_here:
            await controller.engine.resume_generation()
            lap("resume")
        controller.last_update_s = phases
    return results
