"""Sending end of the NIXL weight transport: every trainer rank is a source the inference workers read from.

Protocol (the receiving end is ``prime_rl.inference.weights.nixl_receiver``; shared arithmetic in
``prime_rl.common.nixl_layout``, agent and buffer set-up in
``prime_rl.common.weight_sync.nixl_agent``):

1. Session (``connect``, once). Rank 0 plans the layout (transfer groups of at most ``group_bytes``)
   and stores it in the metadata service under a fresh session id; every rank allocates its slot(s)
   (one, or two with ``overlap``: the size of its largest slice of a group), registers them with a
   NIXL agent (UCX) and publishes its agent metadata. Rank 0 then sends ``InitNixlRequest`` to every
   inference server: their workers load the trainer agents, register their arenas, publish their own
   agents and prepare their reads. Finally every rank loads the receivers' agents (to notify them)
   and the session's receiver list is stored so ranks > 0 learn it without a process group.
2. Update (``push``). Rank 0 sends ``NixlWeightsRequest(version)`` to every server. Every rank, for
   each group g: wait until slot ``g % slots`` is free (every receiver's read of group
   ``g - slots`` has completed: NIXL delivers the ``C:`` credit attached to that read), copy its slice
   of g into the slot, and notify every receiver ``R:<version>:g:<slot>``. Rank 0 finally sends
   ``AwaitWeightsRequest`` and returns when every server serves ``version``.

Depends on torch, NIXL and ``prime_rl.common`` only (no vLLM, no inference code). ``push`` is
``begin`` + ``stage`` + ``finish``; a publisher may leave ``finish`` (the engines' reload) to a
background thread.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Sequence

import msgspec
import torch

from prime_rl.common.nixl_layout import (
    CREDIT,
    DEFAULT_GROUP_BYTES,
    READY,
    NixlProtocolError,
    decode_note,
    encode_note,
    max_slice_bytes,
    pieces_in_range,
    plan_layout,
    source_slices,
)
from prime_rl.common.nixl_metadata import MetadataClient, MetadataService, is_serving
from prime_rl.common.servers import ServerSet
from prime_rl.common.weight_layout import dtype_name
from prime_rl.common.weight_sync.nixl_agent import Backoff, allocate_buffers, make_agent, mem_type, release_agent
from prime_rl.common.weight_transports import NIXL
from prime_rl.common.wire import (
    InitNixlRequest,
    NixlLayout,
    NixlPeer,
    TensorSpec,
)

logger = logging.getLogger(__name__)


class NixlSendError(RuntimeError):
    """An inference server refused or failed a step, or a receiver stopped taking data."""


class NixlSource:
    """One trainer rank's registered slot(s), its agent, and the staging / notification loop."""

    def __init__(
        self,
        client: MetadataClient,
        session: str,
        layout: NixlLayout,
        rank: int,
        *,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self.session, self.layout, self.rank, self.device, self.timeout_s = session, layout, rank, device, timeout_s
        self.slices = [source_slices(size, layout.num_sources)[rank] for size in layout.group_sizes]
        self.pieces = [pieces_in_range(layout, g, s, e) for g, (s, e) in enumerate(self.slices)]
        slot_bytes = max_slice_bytes(layout, rank)
        self.slots = allocate_buffers(layout.num_slots, slot_bytes, device, f"trainer rank {rank}", NixlSendError)
        # A progress thread only with overlap (reads advance while this rank stages the next group).
        self.agent, self.name = make_agent(f"prime-trainer-{rank}", progress_thread=layout.num_slots == 2)
        self._reg = self.agent.register_memory(self.slots)
        peer = NixlPeer(
            name=self.name,
            metadata=self.agent.get_agent_metadata(),
            rank=rank,
            slot_addrs=[s.data_ptr() for s in self.slots],
            slot_bytes=slot_bytes,
            device_id=device.index or 0,
            mem_type=mem_type(device),
        )
        client.put(f"{session}/trainer/{rank}", peer)
        self.receivers: list[str] = []
        self._credits: dict[tuple[int, int], set[str]] = {}

    def connect_receivers(self, peers: Sequence[NixlPeer]) -> None:
        """Load the receivers' agents so this rank can notify them."""
        for peer in peers:
            self.agent.add_remote_agent(peer.metadata)
        self.receivers = [peer.name for peer in peers]

    # -- one update, step by step ----------------------------------------------------------------

    def stage(self, version: int, group: int, tensors: Sequence[torch.Tensor]) -> None:
        """Copy this rank's slice of ``group`` into its slot and announce it to every receiver."""
        start, end = self.slices[group]
        if end <= start:
            return
        slot = group % self.layout.num_slots
        buffer = self.slots[slot]
        for p in self.pieces[group]:
            flat = tensors[p.index].reshape(-1).view(torch.uint8)
            buffer[p.dest : p.dest + p.tensor_end - p.tensor_start].copy_(flat[p.tensor_start : p.tensor_end])
        if buffer.device.type == "cuda":
            torch.cuda.current_stream(buffer.device).synchronize()  # the bytes must be there before a peer reads
        note = encode_note(READY, version, group, slot)
        for name in self.receivers:
            self.agent.send_notif(name, note)

    def wait_credits(self, version: int, group: int) -> None:
        """Block until every receiver's read of ``group`` completed (its slot may be reused)."""
        start, end = self.slices[group]
        if end <= start:
            return
        needed = set(self.receivers)
        deadline, backoff = time.monotonic() + self.timeout_s, Backoff()
        key = (version, group)
        while not needed <= self._credits.get(key, set()):
            for sender, messages in self.agent.get_new_notifs().items():
                for raw in messages:
                    note = decode_note(raw, sender)
                    if note.kind != CREDIT or note.version > version:
                        raise NixlProtocolError(
                            f"trainer rank {self.rank} got notification {raw!r} from {sender} while sending version "
                            f"{version}: receivers only return credits for the version being sent"
                        )
                    if note.version < version:
                        continue  # a late credit of an aborted update
                    self._credits.setdefault((note.version, note.group), set()).add(sender)
            if needed <= self._credits.get(key, set()):
                break
            if time.monotonic() > deadline:
                missing = sorted(needed - self._credits.get(key, set()))
                raise NixlSendError(
                    f"trainer rank {self.rank}: receiver(s) {missing} did not read group {group} of version {version} "
                    f"within {self.timeout_s}s; an inference worker stopped or disappeared"
                )
            backoff()
        self._credits.pop(key, None)

    def publish(self, version: int, tensors: Sequence[torch.Tensor]) -> None:
        """Stage every group of ``version``, reusing a slot only once all receivers have read it."""
        num_groups, num_slots = len(self.layout.group_sizes), self.layout.num_slots
        for g in range(num_groups):
            if g >= num_slots:
                self.wait_credits(version, g - num_slots)
            self.stage(version, g, tensors)
        for g in range(max(0, num_groups - num_slots), num_groups):
            self.wait_credits(version, g)

    def close(self) -> None:
        release_agent(self.agent, self.receivers, self._reg)


class NixlWeightSender:
    """One trainer rank's end of the NIXL transport; rank 0 also drives the inference servers.

    ``addresses``: control endpoints of the inference servers (used by rank 0 only). ``session``: a key
    shared by all ranks of this trainer (rank 0 makes one when None; ranks > 0 must be given it).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        host: str,
        port: int,
        rank: int = 0,
        world_size: int = 1,
        session: str | None = None,
        group_bytes: int = DEFAULT_GROUP_BYTES,
        overlap: bool = False,
        keep_rollback_copy: bool = True,
        timeout_s: float = 600.0,
        device: torch.device | str = "cpu",
        start_service: bool = True,
    ) -> None:
        if rank > 0 and session is None:
            raise ValueError(f"trainer rank {rank} needs the session id chosen by rank 0; pass session=")
        self.addresses = list(addresses)
        self.host, self.port, self.rank, self.world_size = host, port, rank, world_size
        self.session = session or f"prime-rl-{uuid.uuid4().hex[:12]}"
        self.group_bytes, self.num_slots = group_bytes, 2 if overlap else 1
        self.keep_rollback_copy, self.timeout_s = keep_rollback_copy, timeout_s
        self.device = torch.device(device)
        self.service: MetadataService | None = None
        if rank == 0 and start_service and not is_serving(host, port):
            # No job-scoped service (SLURM starts one on the trainer head node): host one here.
            self.service = MetadataService("0.0.0.0" if host not in ("127.0.0.1", "localhost") else host, port).start()
            logger.info("started the NIXL metadata service on %s", self.service.endpoint)
        self.client = MetadataClient(host, port, timeout_s=timeout_s)
        self.servers = ServerSet(self.addresses if rank == 0 else [], timeout_s, error=NixlSendError)
        self.layout: NixlLayout | None = None
        self.source: NixlSource | None = None

    # -- session ---------------------------------------------------------------------------------

    def connect(self, specs: Sequence[TensorSpec]) -> NixlLayout:
        """Set the session up (see the module docstring); every rank calls it with the same specs."""
        layout = self.prepare(specs)
        self.link()
        return layout

    def prepare(self, specs: Sequence[TensorSpec]) -> NixlLayout:
        """Step 1 of ``connect``: the layout (rank 0 plans it) and this rank's registered slots."""
        key = f"{self.session}/layout"
        if self.rank == 0:
            layout = plan_layout(specs, self.world_size, self.group_bytes, self.num_slots)
            self.client.put(key, layout)
        else:
            layout = self.client.wait_get(key, self.timeout_s, NixlLayout)
        self.layout = layout
        self.source = NixlSource(
            self.client, self.session, layout, self.rank, device=self.device, timeout_s=self.timeout_s
        )
        return layout

    def link(self) -> None:
        """Step 2 of ``connect``: rank 0 sets the servers' receivers up; every rank loads their agents."""
        assert self.source is not None, "prepare() first"
        receivers_key = f"{self.session}/receivers"
        if self.rank == 0:
            self.servers.request(
                lambda i: InitNixlRequest(
                    host=self.host,
                    port=self.port,
                    session=self.session,
                    rank_offset=i,
                    keep_rollback_copy=self.keep_rollback_copy,
                    timeout_s=self.timeout_s,
                ),
                "InitNixlRequest",
            )
            names = self.client.keys(f"{self.session}/infer/")
            self.client.put(receivers_key, msgspec.msgpack.encode(names))
        else:
            names = msgspec.msgpack.decode(self.client.wait_get(receivers_key, self.timeout_s), type=list[str])
        peers = [msgspec.msgpack.decode(self.client.get(n), type=NixlPeer) for n in names]
        self.source.connect_receivers(peers)

    def _tensors_in_layout(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """The update's tensors in layout order; the layout is fixed per session, so names/shapes/dtypes must match."""
        assert self.layout is not None
        given = {name: t.detach().contiguous() for name, t in named_tensors}
        out, problems = [], []
        for spec in self.layout.specs:
            t = given.pop(spec.name, None)
            if t is None:
                problems.append(f"{spec.name} missing")
            elif dtype_name(t.dtype) != spec.dtype or list(t.shape) != spec.shape:
                problems.append(
                    f"{spec.name} is {dtype_name(t.dtype)}{list(t.shape)}, session has {spec.dtype}{spec.shape}"
                )
            out.append(t)
        problems += [f"{name} is not in the session layout" for name in given]
        if problems:
            raise NixlSendError(
                "update does not match the NIXL session's layout: " + "; ".join(problems[:5]) + "; every update "
                "must carry the tensors of the first one (connect() again for another model)"
            )
        return out

    # -- updates -----------------------------------------------------------------------------------

    def begin(self, version: int) -> None:
        """Rank 0: ask every server to start pulling ``version``."""
        if self.rank == 0:
            request = NIXL.begin_request(version)
            self.servers.request(request)

    def finish(self, version: int) -> None:
        """Rank 0: wait until every server serves ``version`` (raises with the server's reason otherwise)."""
        if self.rank == 0:
            for request in NIXL.finish_requests(version):
                self.servers.request(request)

    def stage(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every rank: start ``version`` (rank 0 asks the servers) and stage it until every receiver has
        read every group. Call ``finish`` afterwards (rank 0 learns when the engines serve it)."""
        if self.source is None:
            named_tensors = list(named_tensors)
            self.connect([TensorSpec(name=n, dtype=dtype_name(t.dtype), shape=list(t.shape)) for n, t in named_tensors])
        tensors = self._tensors_in_layout(named_tensors)
        self.begin(version)
        try:
            self.source.publish(version, tensors)
        except BaseException:
            # Collect the servers' verdict even when staging failed: it names the cause on their side.
            self.finish(version)
            raise

    def push(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Send one full update; on rank 0 returns (seconds) when every server serves ``version``."""
        start = time.perf_counter()
        self.stage(version, named_tensors)
        self.finish(version)
        return time.perf_counter() - start

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
            self.source = None
        self.servers.close()
        self.client.close()
        if self.service is not None:
            self.service.stop()
            self.service = None
