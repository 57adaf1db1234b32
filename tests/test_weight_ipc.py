"""Both ends of the IPC transport without vLLM: the trainer's ``IpcWeightSender`` fills two shared-memory slots
that several ``IpcReceiver`` s (one per vLLM worker, threads here) read. A slot is refilled only once every
reader acknowledged it, so a slow reader still gets every byte; a reader that gives up stops the sender at
once. Against a real vLLM server: tests/test_server_ipc.py.

Cross-package (trainer sender, inference receiver), so it lives in the root tests/."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from prime_rl.common.net import free_port  # noqa: E402
from prime_rl.common.weight_sync.broadcast import Spec  # noqa: E402
from prime_rl.common.wire import InitIpcRequest  # noqa: E402
from prime_rl.inference.weights.ipc_receiver import IpcReceiver  # noqa: E402
from prime_rl.trainer.weights.ipc_sender import IpcWeightError, IpcWeightSender  # noqa: E402


def _state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {f"layers.{i}.w": torch.randn(64, 48, generator=g).to(torch.bfloat16) for i in range(6)}
    sd["norm"] = torch.randn(48, generator=g)  # another dtype, 192 bytes: re-aligned after it
    sd["big"] = torch.randn(100, 100, generator=g)  # 40 kB > bucket: a bucket of its own, the slots are sized to it
    return sd


def _session(num_workers: int) -> tuple[IpcWeightSender, list[IpcReceiver]]:
    """A sender with no inference server (the control requests are the server test's) and its receivers."""
    sender = IpcWeightSender(
        [], host="127.0.0.1", port=free_port(), memory="host", device=torch.device("cpu"), bucket_bytes=16 << 10,
        timeout_s=30,
    )  # fmt: skip
    sender._open_session(40_000)
    init = InitIpcRequest(
        host="127.0.0.1", port=sender.port, session=sender.channel.session, memory="host", slots=sender.slots,
        timeout_s=30,
    )  # fmt: skip
    receivers = [IpcReceiver(init) for _ in range(num_workers)]
    sender.num_workers = sender.channel.num_workers()
    return sender, receivers


def test_every_reader_gets_every_byte_while_two_slots_are_reused():
    sender, receivers = _session(num_workers=2)
    sd = _state_dict(0)
    layout = sender.plan(Spec.of(n, t) for n, t in sd.items())
    assert len(layout.bucket_sizes) >= 4  # two slots, reused twice or more
    got: list[dict[str, torch.Tensor]] = [{}, {}]

    def read(w: int, delay_s: float) -> None:
        for batch in receivers[w].batches(layout, version=1):
            time.sleep(delay_s)  # a slow reader: the sender must wait for it before refilling the slot
            got[w].update({n: t.clone() for n, t in batch})

    threads = [threading.Thread(target=read, args=(0, 0.0)), threading.Thread(target=read, args=(1, 0.05))]
    for t in threads:
        t.start()
    start = time.monotonic()
    sender.send(1, layout, list(sd.values()))
    blocked = time.monotonic() - start
    for t in threads:
        t.join(timeout=30)
    assert all(set(g) == set(sd) for g in got)
    assert all(torch.equal(g[n], sd[n]) for g in got for n in sd)
    # the sender waited for the slow reader's acks of all but the last two buckets
    assert blocked >= 0.05 * (len(layout.bucket_sizes) - 2)
    paths = [Path(s.path) for s in sender.slots]
    assert all(p.exists() for p in paths)
    sender.close()
    assert not any(p.exists() for p in paths)  # the session's /dev/shm files are unlinked


def test_a_reader_that_gives_up_stops_the_sender_at_once():
    sender, receivers = _session(num_workers=1)
    sd = _state_dict(1)
    layout = sender.plan(Spec.of(n, t) for n, t in sd.items())

    def read_one_bucket() -> None:
        batches = receivers[0].batches(layout, version=2)
        next(batches)
        batches.close()  # the loader stopped (an error while loading): the version is aborted

    t = threading.Thread(target=read_one_bucket)
    t.start()
    start = time.monotonic()
    with pytest.raises(IpcWeightError, match="inference worker 0 gave up at bucket 0: the loader stopped"):
        sender.send(2, layout, list(sd.values()))
    assert time.monotonic() - start < 10  # not the 30 s timeout
    t.join()
    sender.close()


def test_a_bucket_larger_than_the_slots_is_refused_by_the_reader():
    sender, receivers = _session(num_workers=1)
    layout = sender.plan([Spec("huge", "float32", (20_000,))])  # 80 kB > the 40 kB slots of this session
    with pytest.raises(ValueError, match="does not fit the session's 40000-byte slots"):
        next(receivers[0].batches(layout, version=3))
    sender.close()


def _device_reader(init: bytes, layout, out) -> None:
    from prime_rl.common.wire import decode

    receiver = IpcReceiver(decode(init))
    got = {}
    for batch in receiver.batches(layout, version=1):
        got.update({n: t.to("cpu", copy=True) for n, t in batch})
    # plain bytes: a queued tensor is shared through a file descriptor that dies with this process
    buf = io.BytesIO()
    torch.save(got, buf)
    out.put(buf.getvalue())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_slots_are_read_by_another_process_through_cuda_ipc():
    """``memory = "device"``: the slots are CUDA memory of this process, opened by a reader process from their
    IPC handles (a process cannot open its own handles, hence the spawn)."""
    import multiprocessing as mp

    from prime_rl.common.wire import encode

    sender = IpcWeightSender(
        [], host="127.0.0.1", port=free_port(), memory="device", device=torch.device("cuda", 0),
        bucket_bytes=16 << 10, timeout_s=120,
    )  # fmt: skip
    sender._open_session(40_000)
    assert sender.buffers[0].is_cuda and sender.slots[0].device_uuid and sender.slots[0].handle
    init = InitIpcRequest(
        host="127.0.0.1", port=sender.port, session=sender.channel.session, memory="device", slots=sender.slots,
        timeout_s=120,
    )  # fmt: skip
    sd = {n: t.cuda() for n, t in _state_dict(2).items()}
    layout = sender.plan(Spec.of(n, t) for n, t in sd.items())
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_device_reader, args=(encode(init), layout, out))
    p.start()
    deadline = time.monotonic() + 120
    while sender.channel.num_workers() < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    sender.num_workers = 1
    sender.send(1, layout, list(sd.values()))
    got = torch.load(io.BytesIO(out.get(timeout=120)))
    p.join(timeout=60)
    assert p.exitcode == 0
    assert set(got) == set(sd) and all(torch.equal(got[n], sd[n].cpu()) for n in sd)
    sender.close()
