"""The lifecycle of one policy version under each weight transport, as one table (``TRANSPORTS``).

Four transports move the trainer's weights into the inference workers (``[weight_broadcast] type``). They
differ in who holds the bytes inference reads, which trainer ranks take part, who makes inference load, what
the announcement carries and which control requests do it. That used to be prose spread over the publishers,
the controller and the orchestrator; here it is data, read by code:

- the publishers (``prime_rl.trainer.rl.publish*``) refuse a transport whose loading the trainer drives when no
  inference control address is given (``Transport.loads == "trainer"``);
- the inference controller (``prime_rl.inference.control``) applies each transport's version rule
  (``refuse_version``) and the request sets below are checked against what it answers
  (packages/inference/tests/test_control_push.py);
- the rows are checked against the config's transport types (packages/common/tests/test_weight_transports.py).

What every transport shares: a version ``n`` exists for the rest of the system only once the trainer's global
rank 0 has sent ``WeightsPublished(n)`` to the orchestrator (``ANNOUNCER``), and only once it is whole.

Loading, for every transport, is this table's ``update`` requests (``Transport.begin_request`` /
``finish_requests`` build them) sent to every server through one fan-out, ``prime_rl.common.servers.ServerSet``.
Who sends them is the row's ``loads``: the orchestrator for the filesystem transport (it closes its request gate
around the load, which keeps its version tags exact, and only it can close that gate), trainer rank 0 for the
push transports (the begin request arms the workers, the sender's own transfer follows, then the wait; moving
that to the orchestrator would add a round trip per version between the two processes).

Torch-free (``prime_rl.common.wire`` only), beside the torch-level ``prime_rl.common.weight_sync`` package as
``weight_layout`` is, so the orchestrator, launcher and config checks may read it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prime_rl.common.wire import (
    AwaitWeightsRequest,
    BroadcastWeightsRequest,
    InitBroadcastRequest,
    InitIpcRequest,
    InitNixlRequest,
    IpcWeightsRequest,
    LoadWeightsRequest,
    Message,
    NixlWeightsRequest,
)

ANNOUNCER = "trainer global rank 0"
"""Who sends ``WeightsPublished`` to the orchestrator, under every transport."""


@dataclass(frozen=True)
class Transport:
    """Who does what for one policy version under one transport."""

    name: Literal["filesystem", "nccl", "nixl", "ipc"]
    """``[weight_broadcast] type``."""
    serves: str
    """Who holds the bytes inference reads, and where."""
    sending_ranks: Literal["rank 0", "every rank"]
    """Trainer ranks that take part in moving a version (the rest only join the all-gathers)."""
    announced_when: str
    """What must have happened before ``ANNOUNCER`` announces the version."""
    announces_path: bool
    """``WeightsPublished.path`` names a directory to load (True), or is None: inference already serves it."""
    loads: Literal["orchestrator", "trainer"]
    """Who sends the control requests that make inference load a version."""
    setup: tuple[type[Message], ...]
    """Control requests sent once per session, to every inference server, before the first version."""
    update: tuple[type[Message], ...]
    """Control requests sent per version, in this order, to every inference server."""
    versions_increase: bool
    """The server refuses a version not above the one it serves (``refuse_version``). The filesystem
    transport reloads any version (a restore, a resumed run); a broadcast is not checked."""

    def begin_request(self, version: int, **fields: object) -> Message:
        """The first of ``update`` for ``version``, with what it carries (the filesystem path, a streamed layout):
        the request that starts the load on every server. Both loading sides build it here."""
        return self.update[0](version=version, **fields)

    def finish_requests(self, version: int) -> tuple[Message, ...]:
        """The rest of ``update`` for ``version``, sent once the bytes went out (push transports: the wait until
        every server serves it); none for the filesystem transport, whose begin request answers once loaded."""
        return tuple(request(version=version) for request in self.update[1:])


def _pushed(
    name: Literal["nccl", "nixl", "ipc"],
    serves: str,
    *,
    setup: type[Message],
    first: type[Message],
    sending_ranks: Literal["rank 0", "every rank"] = "rank 0",
    versions_increase: bool = False,
) -> Transport:
    """A push transport's row: trainer rank 0 drives the load (``setup`` once per session, then ``first`` per
    version), ``AwaitWeightsRequest`` ends every version, and the version is announced without a path once every
    server answered it. What the three push transports share lives here once; their rows state only how they
    differ."""
    return Transport(
        name=name,
        serves=serves,
        sending_ranks=sending_ranks,
        announced_when="every inference server answered AwaitWeightsRequest: it serves version n",
        announces_path=False,
        loads="trainer",
        setup=(setup,),
        update=(first, AwaitWeightsRequest),
        versions_increase=versions_increase,
    )


TRANSPORTS: dict[str, Transport] = {
    t.name: t
    for t in (
        Transport(
            name="filesystem",
            serves="trainer rank 0's background writer: safetensors in <run_dir>/broadcasts/step_<n>/",
            sending_ranks="rank 0",
            announced_when="step_<n>.tmp/ is written, fsynced and renamed to step_<n>/",
            announces_path=True,
            loads="orchestrator",
            setup=(),
            update=(LoadWeightsRequest,),
            versions_increase=False,
        ),
        _pushed(
            "nccl",
            "trainer rank 0: broadcasts byte buckets into a group it hosts (NCCL on GPU, gloo on CPU)",
            setup=InitBroadcastRequest,
            first=BroadcastWeightsRequest,
        ),
        _pushed(
            "nixl",
            "every trainer rank: its slice of each transfer group in registered slots the workers read",
            setup=InitNixlRequest,
            first=NixlWeightsRequest,
            sending_ranks="every rank",
            versions_increase=True,
        ),
        _pushed(
            "ipc",
            "trainer rank 0: a ring of shared buckets on its GPU (CUDA IPC) or in /dev/shm, refilled as read",
            setup=InitIpcRequest,
            first=IpcWeightsRequest,
        ),
    )
}


FILESYSTEM = TRANSPORTS["filesystem"]
NCCL = TRANSPORTS["nccl"]
NIXL = TRANSPORTS["nixl"]
IPC = TRANSPORTS["ipc"]
"""Each transport's row by name, for the module that implements it (the requests it sends or answers)."""


def refuse_version(transport: str, version: int, served: int) -> str | None:
    """Why an inference server serving ``served`` refuses ``version`` under ``transport``; None if it may load it."""
    if TRANSPORTS[transport].versions_increase and version <= served:
        return (
            f"refused {transport.upper()} update to version {version}: version {served} is served and "
            "versions must increase"
        )
    return None
