"""Receiving end of the NIXL weight transport: one ``NixlReceiver`` per inference worker.

Set-up (once per trainer session, ``InitNixlRequest``): read the session's layout and every trainer
rank's agent metadata from the metadata service, allocate the transfer arena(s) (two with
``overlap_transfer_and_replay``: one being loaded while the next group arrives), register them with a
NIXL agent (UCX), publish this agent, and prepare one READ request per (group, trainer rank). Later
updates only post those prepared requests.

One update (``receive``), for each group g:
1. wait until every trainer rank holding a non-empty slice of g has sent ``R:<version>:g:<slot>``;
   a notification of another version, an unknown group or a repeated one is refused;
2. post every trainer-rank read of g at once, starting at a different rank per receiver; each read
   carries the credit ``C:<version>:g:<slot>`` that NIXL delivers to its trainer rank when it completes;
3. hand the group's tensors (views of the arena) to ``load`` -- with overlap, the previous group is
   loaded while these reads are in flight.

A peer that disappears shows up as a failed read or a readiness notification that never comes
(``timeout_s``); ``receive`` then raises ``NixlTransferError``. With ``keep_rollback_copy`` every
received group is also copied into a host buffer; after a complete update it becomes the rollback
copy the worker reloads when a later update fails after some groups reached the engine. That costs
two host copies of the weights; without it a failure after the first loaded group leaves the model
partially updated (and says so).

Pure torch + NIXL: no vLLM here, so plain processes (tests, benchmarks) can receive too. The sending
end is ``prime_rl.trainer.weights.nixl_source``; agent and buffer set-up are shared in
``prime_rl.common.weight_sync.nixl_agent``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import torch

from prime_rl.common.nixl_layout import (
    CREDIT,
    READY,
    NixlProtocolError,
    decode_note,
    encode_note,
    num_bytes,
    read_order,
    source_slices,
)
from prime_rl.common.nixl_metadata import MetadataClient
from prime_rl.common.weight_sync.nixl_agent import Backoff, allocate_buffers, make_agent, mem_type, release_agent
from prime_rl.common.wire import NixlLayout, NixlPeer

logger = logging.getLogger(__name__)


class NixlTransferError(RuntimeError):
    """An update could not be received (a peer vanished, a read failed, a notification was refused)."""


def allocate_arenas(count: int, size: int, device: torch.device, what: str) -> list[torch.Tensor]:
    """``count`` receive arenas of ``size`` bytes (raises ``NixlTransferError`` naming the knobs)."""
    return allocate_buffers(count, size, device, what, NixlTransferError)


class NixlReceiver:
    """One worker's receiving side of a trainer session."""

    def __init__(
        self,
        client: MetadataClient,
        session: str,
        rank: int,
        *,
        device: torch.device,
        keep_rollback_copy: bool = True,
        timeout_s: float = 600.0,
    ) -> None:
        self.session, self.rank, self.device, self.timeout_s = session, rank, device, timeout_s
        self.layout: NixlLayout = client.wait_get(f"{session}/layout", timeout_s, NixlLayout)
        layout = self.layout
        self.sources: list[NixlPeer] = [
            client.wait_get(f"{session}/trainer/{r}", timeout_s, NixlPeer) for r in range(layout.num_sources)
        ]
        self.num_arenas = layout.num_slots
        self.arenas = allocate_arenas(self.num_arenas, max(layout.group_sizes), device, "receiver")
        self.agent, self.name = make_agent(f"prime-infer-{rank}", progress_thread=self.num_arenas == 2)
        self._reg = self.agent.register_memory(self.arenas)
        for peer in self.sources:
            self.agent.add_remote_agent(peer.metadata)
        self.source_names = [peer.name for peer in self.sources]
        self.order = read_order(rank, layout.num_sources)
        self.slices = [source_slices(size, layout.num_sources) for size in layout.group_sizes]
        self._prepare_reads()
        client.put(
            f"{session}/infer/{self.name}",
            NixlPeer(name=self.name, metadata=self.agent.get_agent_metadata(), rank=rank),
        )
        self.total_bytes = sum(layout.group_sizes)
        # Rollback copies: ``_current`` holds the last complete NIXL update (None until there is one),
        # ``_next`` collects the update in progress; they swap when it completes.
        self.keep_rollback_copy = keep_rollback_copy
        self._current: torch.Tensor | None = None
        self._next: torch.Tensor | None = None
        self.version = -1
        """Last version received completely."""
        self._pending: list[tuple[str, bytes]] = []

    # -- set-up --------------------------------------------------------------------------------

    def _prepare_reads(self) -> None:
        """One prepared READ per (group, trainer rank with a non-empty slice), reused by every update."""
        layout, kind = self.layout, mem_type(self.device)
        local, local_index = [], {}
        for a, arena in enumerate(self.arenas):
            for g in range(len(layout.group_sizes)):
                if g % self.num_arenas != a:
                    continue
                for r, (start, end) in enumerate(self.slices[g]):
                    if end > start:
                        local_index[(g, r)] = len(local)
                        local.append((arena.data_ptr() + start, end - start, self.device.index or 0))
        local_dlist = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, kind)
        self._dlists = [local_dlist]
        self.reads: dict[tuple[int, int], object] = {}
        for r, (peer, remote_name) in enumerate(zip(self.sources, self.source_names)):
            remote, remote_index = [], {}
            for g in range(len(layout.group_sizes)):
                start, end = self.slices[g][r]
                if end > start:
                    if end - start > peer.slot_bytes:
                        raise NixlProtocolError(
                            f"trainer rank {r} slots hold {peer.slot_bytes} bytes but group {g} needs {end - start}; "
                            "the trainer and the layout disagree, restart the trainer"
                        )
                    remote_index[g] = len(remote)
                    remote.append((peer.slot_addrs[g % len(peer.slot_addrs)], end - start, peer.device_id))
            if not remote:
                continue
            remote_dlist = self.agent.prep_xfer_dlist(remote_name, remote, peer.mem_type)
            self._dlists.append(remote_dlist)
            for g, i in remote_index.items():
                self.reads[(g, r)] = self.agent.make_prepped_xfer(
                    "READ", local_dlist, [local_index[(g, r)]], remote_dlist, [i], encode_note(CREDIT, 0, g, 0)
                )

    # -- notifications -------------------------------------------------------------------------

    def _poll_notes(self) -> None:
        for sender, messages in self.agent.get_new_notifs().items():
            self._pending.extend((sender, m) for m in messages)

    def _drain_stale(self, version: int) -> None:
        """Drop readiness notes of older versions left by an aborted update; keep newer ones."""
        self._poll_notes()
        kept = []
        for sender, raw in self._pending:
            note = decode_note(raw, sender)
            if note.version < version:
                logger.warning(
                    "dropping stale NIXL notification %r from %s (receiving version %d)", raw, sender, version
                )
            else:
                kept.append((sender, raw))
        self._pending = kept

    def _wait_ready(self, version: int, group: int, ready: dict[int, set[int]]) -> None:
        """Block until every trainer rank with a slice of ``group`` announced it for ``version``."""
        needed = {r for r, (s, e) in enumerate(self.slices[group]) if e > s}
        deadline, backoff = time.monotonic() + self.timeout_s, Backoff()
        while not needed <= ready.get(group, set()):
            self._poll_notes()
            for sender, raw in self._pending:
                self._accept(decode_note(raw, sender), sender, version, group, ready)
            self._pending.clear()
            if needed <= ready.get(group, set()):
                break
            if time.monotonic() > deadline:
                missing = sorted(needed - ready.get(group, set()))
                raise NixlTransferError(
                    f"trainer rank(s) {missing} did not announce group {group} of version {version} within "
                    f"{self.timeout_s}s: the trainer stopped or disappeared mid-transfer"
                )
            backoff()
        ready.pop(group, None)

    def _accept(self, note, sender: str, version: int, group: int, ready: dict[int, set[int]]) -> None:
        if sender not in self.source_names:
            raise NixlProtocolError(
                f"NIXL notification {note} from {sender}, which is not a trainer rank of this session"
            )
        rank = self.source_names.index(sender)
        if note.kind != READY or note.version != version:
            raise NixlProtocolError(
                f"refused out-of-order notification {note.kind}:{note.version}:{note.group} from trainer rank {rank} "
                f"while receiving version {version}: a source must announce only the version being pulled"
            )
        if not group <= note.group < min(group + self.layout.num_slots, len(self.layout.group_sizes)):
            raise NixlProtocolError(
                f"refused notification for group {note.group} of version {version} from trainer rank {rank} while "
                f"waiting for group {group}: with {self.layout.num_slots} slot(s) a source may be at most "
                f"{self.layout.num_slots - 1} group(s) ahead"
            )
        if note.slot != note.group % self.layout.num_slots:
            raise NixlProtocolError(
                f"notification {note} names slot {note.slot}; group {note.group} uses slot {note.group % self.layout.num_slots}"
            )
        if rank in ready.setdefault(note.group, set()):
            raise NixlProtocolError(f"trainer rank {rank} announced group {note.group} of version {version} twice")
        ready[note.group].add(rank)

    # -- one update ----------------------------------------------------------------------------

    def _post(self, version: int, group: int) -> list:
        posted = []
        slot = group % self.layout.num_slots
        for r in self.order:
            handle = self.reads.get((group, r))
            if handle is None:
                continue
            state = self.agent.transfer(handle, encode_note(CREDIT, version, group, slot))
            if state == "ERR":
                raise NixlTransferError(f"posting the read of group {group} from trainer rank {r} failed")
            posted.append((r, handle))
        return posted

    def _wait_reads(self, version: int, group: int, posted: list) -> None:
        deadline, backoff = time.monotonic() + self.timeout_s, Backoff()
        for r, handle in posted:
            while (state := self.agent.check_xfer_state(handle)) == "PROC":
                if time.monotonic() > deadline:
                    raise NixlTransferError(
                        f"read of group {group} (version {version}) from trainer rank {r} timed out"
                    )
                backoff()
            if state != "DONE":
                raise NixlTransferError(
                    f"read of group {group} (version {version}) from trainer rank {r} failed ({state}): "
                    "the trainer rank disappeared mid-transfer"
                )

    def group_tensors(self, group: int, buffer: torch.Tensor, base: int = 0) -> list[tuple[str, torch.Tensor]]:
        """Views of the tensors of ``group`` in ``buffer`` (the group's bytes start at ``base``)."""
        out = []
        layout = self.layout
        for i, g in enumerate(layout.groups):
            if g != group:
                continue
            spec = layout.specs[i]
            off = base + layout.offsets[i]
            view = buffer[off : off + num_bytes(spec)].view(getattr(torch, spec.dtype)).view(spec.shape)
            out.append((spec.name, view))
        return out

    def _keep(self, group: int, arena: torch.Tensor) -> None:
        if not self.keep_rollback_copy:
            return
        if self._next is None:
            self._next = allocate_arenas(1, self.total_bytes, torch.device("cpu"), "rollback")[0]
        base = sum(self.layout.group_sizes[:group])
        size = self.layout.group_sizes[group]
        self._next[base : base + size].copy_(arena[:size])

    def receive(self, version: int, load: Callable[[list[tuple[str, torch.Tensor]]], None]) -> dict:
        """Pull ``version`` group by group and pass each group's tensors to ``load``; raises on failure."""
        if version <= self.version:
            raise NixlProtocolError(
                f"refused version {version}: version {self.version} was already received; versions must increase"
            )
        start = time.perf_counter()
        self._drain_stale(version)
        ready: dict[int, set[int]] = {}
        num_groups = len(self.layout.group_sizes)
        overlap = self.num_arenas == 2
        for g in range(num_groups):
            self._wait_ready(version, g, ready)
            posted = self._post(version, g)
            if overlap and g > 0:  # load the previous group while this one is on the wire
                self._load(g - 1, load)
            self._wait_reads(version, g, posted)
            if not overlap:
                self._load(g, load)
        if overlap:
            self._load(num_groups - 1, load)
        if self.keep_rollback_copy:
            self._current, self._next = self._next, self._current
        self.version = version
        seconds = time.perf_counter() - start
        return {"groups": num_groups, "bytes": self.total_bytes, "seconds": seconds}

    def _load(self, group: int, load: Callable) -> None:
        arena = self.arenas[group % self.num_arenas]
        load(self.group_tensors(group, arena))
        self._keep(group, arena)

    def rollback_batches(self) -> Iterator[list[tuple[str, torch.Tensor]]] | None:
        """The last complete update, group by group, or None when there is no rollback copy."""
        if self._current is None:
            return None
        bases = [sum(self.layout.group_sizes[:g]) for g in range(len(self.layout.group_sizes))]
        return (self.group_tensors(g, self._current, bases[g]) for g in range(len(bases)))

    def invalidate_rollback(self) -> None:
        """Another transport replaced the weights: the copy no longer holds what is served."""
        self._current = None

    def close(self) -> None:
        for handle in self.reads.values():
            handle.release()
        for dlist in self._dlists:
            dlist.release()
        release_agent(self.agent, self.source_names, self._reg)
