"""The IPC transport's protocol shared by trainer and inference: shared slots, the bucket channel, the wire.

The two ends together (the trainer's ``IpcWeightSender``, inference's ``IpcReceiver``) are
tests/test_weight_ipc.py; against a real vLLM server, tests/test_server_ipc.py."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest

torch = pytest.importorskip("torch", reason="prime_rl.common.weight_sync needs prime-rl-common[torch]")

from prime_rl.common.net import free_port  # noqa: E402
from prime_rl.common.weight_sync.broadcast import Spec, pack_bucket, pack_into, plan_buckets  # noqa: E402
from prime_rl.common.weight_sync.ipc import (  # noqa: E402
    IpcAborted,
    IpcChannel,
    allocate_slots,
    open_slot,
    remove_slots,
)
from prime_rl.common.wire import InitIpcRequest, IpcSlot, IpcWeightsRequest, TensorSpec, decode, encode  # noqa: E402


def _read_slot_in_child(slot: IpcSlot, out) -> None:
    buffer = open_slot("host", slot)
    out.put(buffer[:8].tolist())
    buffer[8:16] = 7  # written back through the shared mapping


def test_host_slots_are_shared_with_another_process_both_ways():
    buffers, slots = allocate_slots("host", 2, 4096, torch.device("cpu"), "test-host-slots")
    try:
        assert [s.size for s in slots] == [4096, 4096] and slots[0].path != slots[1].path
        buffers[1][:8] = torch.arange(8, dtype=torch.uint8)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        p = ctx.Process(target=_read_slot_in_child, args=(slots[1], out))
        p.start()
        p.join(timeout=120)
        assert p.exitcode == 0
        assert out.get(timeout=5) == list(range(8))
        assert buffers[1][8:16].tolist() == [7] * 8
    finally:
        remove_slots(slots)
    with pytest.raises(FileNotFoundError, match="do not share /dev/shm"):
        open_slot("host", slots[0])


def test_device_memory_is_refused_for_a_cpu_trainer():
    with pytest.raises(ValueError, match='use memory="host"'):
        allocate_slots("device", 2, 4096, torch.device("cpu"), "test-cpu")
    with pytest.raises(ValueError, match="not one of"):
        allocate_slots("disk", 2, 4096, torch.device("cpu"), "test-disk")


def test_pack_into_a_reused_slot_matches_a_fresh_bucket():
    g = torch.Generator().manual_seed(0)
    sd = {"a": torch.randn(40, 8, generator=g).bfloat16(), "b": torch.randn(5, generator=g), "c": torch.randn(300)}
    layout = plan_buckets([Spec.of(n, t) for n, t in sd.items()], bucket_bytes=1 << 10)
    tensors = list(sd.values())
    slot = torch.full((max(layout.bucket_sizes) + 100,), 255, dtype=torch.uint8)
    for b in range(len(layout.bucket_sizes)):
        packed = pack_into(layout, b, tensors, slot)
        assert packed.numel() == layout.bucket_sizes[b]
        fresh = pack_bucket(layout, b, tensors, torch.device("cpu"))
        for i in layout.tensors_of(b):  # padding between tensors is not part of the contract, the tensors are
            off, n = layout.offsets[i], layout.specs[i].num_bytes
            assert torch.equal(packed[off : off + n], fresh[off : off + n])
    with pytest.raises(ValueError, match="needs .* bytes; the buffer has 16"):
        pack_into(layout, 0, tensors, torch.empty(16, dtype=torch.uint8))


def test_channel_ready_ack_and_abort_between_ends():
    port = free_port()
    trainer = IpcChannel.connect("127.0.0.1", port, "s1", True, timeout_s=30)
    workers = [IpcChannel.connect("127.0.0.1", port, "s1", False, timeout_s=30) for _ in range(2)]
    assert [w.register_worker() for w in workers] == [0, 1] and trainer.num_workers() == 2

    with pytest.raises(TimeoutError, match="bucket 0 from the trainer"):
        workers[0].wait_ready(3, 0, timeout_s=0.05)
    trainer.set_ready(3, 0)
    workers[0].wait_ready(3, 0, timeout_s=1)

    def ack_later() -> None:
        time.sleep(0.2)
        workers[0].ack(3, 0, 0)
        workers[1].ack(3, 0, 1)

    t = threading.Thread(target=ack_later)
    start = time.monotonic()
    t.start()
    trainer.wait_acks(3, 0, 2, timeout_s=10)  # returns once both acknowledged, not before
    assert time.monotonic() - start >= 0.2
    t.join()

    workers[1].abort(3, "worker 1 gave up: NaN")
    with pytest.raises(IpcAborted, match="worker 1 gave up: NaN"):
        trainer.wait_acks(3, 1, 2, timeout_s=10)  # ends at once, not at the timeout
    trainer.clear(3, 2, 2)
    with pytest.raises(TimeoutError):
        workers[0].wait_ready(3, 0, timeout_s=0.05)  # the version's keys are gone


def test_ipc_requests_round_trip_on_the_wire():
    slot = IpcSlot(size=1 << 20, device_uuid="GPU-1", handle=b"\x00\x01", storage_size_bytes=1 << 21, tensor_offset=3)
    init = InitIpcRequest(host="h", port=1, session="s", memory="device", slots=[slot, IpcSlot(size=5, path="/p")])
    assert decode(encode(init)) == init
    update = IpcWeightsRequest(
        version=4, specs=[TensorSpec("w", "bfloat16", [2, 3])], buckets=[0], offsets=[0], bucket_sizes=[12]
    )
    assert decode(encode(update)) == update


def _non_loopback_address() -> str | None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_the_trainers_channel_listens_on_its_host_alone():
    import socket

    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to probe")
    port = free_port()
    channel = IpcChannel.connect("127.0.0.1", port, "s", True, timeout_s=5)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((address, port), timeout=2)
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert channel.num_workers() == 0
