"""NIXL set-up shared by both ends of the NIXL weight transport: the API import, agents, buffers, polling.

``prime_rl.trainer.weights.nixl_source`` (trainer ranks) and ``prime_rl.inference.weights.nixl_receiver``
(inference workers) build their agents, register their buffers and poll with these helpers, so the two
ends cannot drift apart.
"""

from __future__ import annotations

import time
import uuid

import torch

POLL_S = 0.005
"""Longest pause between two polls of NIXL state; shorter at first (see ``Backoff``)."""


class Backoff:
    """Sleeps that grow from 50 us to ``POLL_S``: quick to notice a fast peer, cheap on two shared cores."""

    def __init__(self) -> None:
        self.delay = 50e-6

    def __call__(self) -> None:
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, POLL_S)


def import_nixl():
    """The NIXL Python API from whichever CUDA variant wheel is installed (``nixl-cu13`` / ``nixl-cu12``)."""
    errors = []
    for module in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return __import__(module, fromlist=["nixl_agent"])
        except ImportError as e:
            errors.append(f"{module}: {e}")
    raise ImportError(
        "weight_broadcast.type='nixl' needs NIXL: pip install 'prime-rl-trainer[nixl]' or "
        "'prime-rl-inference[nixl]' (nixl-cu13); " + "; ".join(errors)
    )


def mem_type(device: torch.device) -> str:
    return "VRAM" if device.type == "cuda" else "DRAM"


def allocate_buffers(
    count: int, size: int, device: torch.device, what: str, error: type[Exception]
) -> list[torch.Tensor]:
    """``count`` byte buffers of ``size`` bytes; a failure names the size and the knobs that shrink it."""
    try:
        return [torch.empty(max(size, 1), dtype=torch.uint8, device=device) for _ in range(count)]
    except (RuntimeError, MemoryError) as e:
        raise error(
            f"could not allocate {count} {what} transfer buffer(s) of {size} bytes on {device}: {e}; lower "
            "weight_broadcast.group_bytes or set weight_broadcast.overlap_transfer_and_replay = false "
            "(overlap needs two)"
        ) from e


def make_agent(prefix: str, progress_thread: bool):
    """A UCX agent named ``<prefix>-<random>``. ``progress_thread``: only with overlap, where transfers must
    advance while this process does other work; otherwise it polls whenever it waits, and a progress
    thread only adds wake-up latency (measured here: 25 -> 11 ms per group on two busy cores)."""
    api = import_nixl()
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    return api.nixl_agent(name, config), name


def release_agent(agent, peers, registration) -> None:  # noqa: ANN001 - nixl objects
    """Forget every peer agent (one that is gone already is skipped) and deregister our memory."""
    for name in peers:
        try:
            agent.remove_remote_agent(name)
        except Exception:  # the peer may be gone already
            pass
    agent.deregister_memory(registration)
