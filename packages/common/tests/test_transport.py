import threading
import time

import msgspec
import numpy as np
import pytest
import zmq

from prime_rl.common import wire
from prime_rl.common.transport import (
    ALIGN,
    SHARED_FRAME_MAX_BYTES,
    ZERO_COPY_MIN_BYTES,
    ControlClient,
    ControlServer,
    PeerLostError,
    Receiver,
    Sender,
    decode_frames,
    encode_frames,
)

LOOPBACK = "tcp://127.0.0.1:0"  # bind picks a free port; .endpoint has the real one


@pytest.fixture
def pair():
    receiver = Receiver(LOOPBACK, timeout_s=5.0)
    sender = Sender(receiver.endpoint, timeout_s=5.0)
    yield sender, receiver
    sender.close()
    receiver.close()


def _batch(n: int = 16):
    fields = {
        "input_ids": np.arange(n, dtype=np.int32),
        "position_ids": np.arange(n, dtype=np.int32),
        "loss_mask": np.ones(n, dtype=bool),
        "advantages": np.full(n, 0.5, dtype=np.float32),
        "inference_logprobs": -np.arange(n, dtype=np.float32),
    }
    return wire.build_training_batch(1, 0, [fields, fields], 1.0, {"reward/mean": 0.25})


def _frame_owner(array: np.ndarray):
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return base


def test_batch_arrives_intact_as_views_over_the_frames(pair):
    sender, receiver = pair
    batch, arrays = _batch()
    sender.send(batch, arrays)
    got = receiver.recv()
    assert got.message == batch
    assert set(got.arrays) == set(arrays)
    for name, array in arrays.items():
        np.testing.assert_array_equal(got.arrays[name], array)
        assert got.arrays[name].dtype == array.dtype
        # no copy: the array's memory is the received ZeroMQ frame
        owner = _frame_owner(got.arrays[name])
        assert isinstance(owner, memoryview) and isinstance(owner.obj, zmq.Frame)
        assert got.arrays[name].flags.writeable  # the receiver owns the frame; torch.from_numpy needs this
    fields = wire.micro_batch_arrays(got.message.micro_batches[1], got.arrays)
    np.testing.assert_array_equal(fields["inference_logprobs"], arrays["mb1/inference_logprobs"])


def test_large_frame_is_sent_without_a_copy_on_the_send_path():
    array = np.arange(1 << 20, dtype=np.float32)
    frames = encode_frames(wire.HealthRequest(), {"x": array})
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.float32), array)


def test_small_arrays_share_frames_large_ones_get_their_own():
    small = {f"s{i}": np.full(1000 + i, i, dtype=np.int8 if i % 2 else np.float32) for i in range(10)}
    big = np.arange(ZERO_COPY_MIN_BYTES // 4, dtype=np.float32)
    frames = encode_frames(wire.HealthRequest(), {**small, "big": big, "tail": np.ones(3, np.float64)})
    _, specs, placements = wire.decode_header(frames[0])
    assert len(frames) == 1 + 2  # one shared frame (small arrays + tail) and the big array's own
    assert placements[10] == (1, 0) and {p[0] for i, p in enumerate(placements) if i != 10} == {0}
    assert all(offset % ALIGN == 0 for _, offset in placements)
    got = decode_frames([zmq.Frame(f) for f in frames])
    for name, array in small.items():
        np.testing.assert_array_equal(got.arrays[name], array)
        assert got.arrays[name].flags.aligned
    np.testing.assert_array_equal(got.arrays["big"], big)
    np.testing.assert_array_equal(got.arrays["tail"], [1, 1, 1])


def test_shared_frames_are_capped():
    n = SHARED_FRAME_MAX_BYTES // (ZERO_COPY_MIN_BYTES // 2) + 4
    arrays = {f"a{i}": np.full(ZERO_COPY_MIN_BYTES // 2, i % 251, dtype=np.uint8) for i in range(n)}
    frames = encode_frames(wire.HealthRequest(), arrays)
    assert len(frames) == 1 + 2 and all(len(memoryview(f)) <= SHARED_FRAME_MAX_BYTES for f in frames[1:])
    got = decode_frames(frames)
    assert all(got.arrays[f"a{i}"][0] == i % 251 for i in range(n))


def test_odd_arrays_round_trip(pair):
    sender, receiver = pair
    arrays = {
        "scalar": np.float32(3.5),
        "empty": np.zeros((0, 3)),
        "strided": np.arange(24, dtype=np.int64).reshape(4, 6)[:, ::2],
        "uint8": np.arange(5, dtype=np.uint8),
    }
    sender.send(wire.HealthRequest(), arrays)
    got = receiver.recv()
    for name, array in arrays.items():
        assert got.arrays[name].shape == np.shape(array)
        np.testing.assert_array_equal(got.arrays[name], array)


def test_garbage_then_good_message_delivers_the_good_one(pair, caplog):
    sender, receiver = pair
    raw = sender._socket  # inject bytes no Sender would produce
    raw.send_multipart([b"\xc1 not msgpack"])
    raw.send_multipart([wire.encode(wire.HealthRequest()), b"unexpected extra frame"])
    header = wire.encode_header(wire.HealthRequest(), [wire.TensorSpec("x", "float32", [4])])
    raw.send_multipart([header, b"too short"])
    header = wire.encode_header(wire.HealthRequest(), [wire.TensorSpec("x", "float32", [1])], [(0, 2)])
    raw.send_multipart([header, b"12345678"])  # misaligned view
    raw.send_multipart([wire.encode_header(wire.HealthRequest(), [wire.TensorSpec("x", "object", [1])]), b"12345678"])
    sender.send(wire.LoadWeightsRequest(path="/w", version=3))
    with caplog.at_level("ERROR"):
        got = receiver.recv()
    assert got.message == wire.LoadWeightsRequest(path="/w", version=3)
    assert receiver.num_rejected == 5
    assert "refused a message" in caplog.text and receiver.endpoint in caplog.text


def test_other_schema_version_is_refused_and_the_receiver_keeps_running(pair, caplog):
    sender, receiver = pair
    sender._socket.send(msgspec.msgpack.encode((wire.SCHEMA_VERSION + 1, ["HealthRequest"], [], [])))
    sender.send(wire.HealthRequest())
    with caplog.at_level("ERROR"):
        assert receiver.recv().message == wire.HealthRequest()
    assert receiver.num_rejected == 1
    assert f"schema version {wire.SCHEMA_VERSION + 1}" in receiver.last_error
    assert "schema version" in caplog.text


def test_recv_timeout_names_endpoint_and_timeout(pair):
    _, receiver = pair
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"{receiver.endpoint}.*0.2s"):
        receiver.recv(timeout_s=0.2)
    assert time.monotonic() - start < 2


def test_send_without_receiver_times_out(tmp_path):
    # Nothing listens on this endpoint: ZMQ_IMMEDIATE turns that into a timeout, not a silent queue.
    # (An ipc path nobody binds: a freed tcp port could be taken by a parallel test in between.)
    endpoint = f"ipc://{tmp_path}/nobody"
    with Sender(endpoint, timeout_s=0.2) as sender:
        with pytest.raises(TimeoutError, match=rf"{endpoint}.*0.2s"):
            sender.send(wire.HealthRequest())


def test_a_queueing_sender_does_not_wait_for_a_reader_and_delivers_once_one_binds(tmp_path):
    """Notifications (the trainer's version announcements) must not block on a reader that comes later or has
    gone: the message waits in the queue and arrives when a receiver binds."""
    endpoint = f"ipc://{tmp_path}/later"
    with Sender(endpoint, timeout_s=0.2, queue_without_peer=True) as sender:
        start = time.monotonic()
        sender.send(wire.HealthRequest())
        assert time.monotonic() - start < 0.2
        with Receiver(endpoint, bind=True, timeout_s=5.0) as receiver:
            message, _ = receiver.recv()
    assert isinstance(message, wire.HealthRequest)


def test_unsendable_dtype_is_refused():
    with pytest.raises(TypeError, match="dtype object"):
        encode_frames(wire.HealthRequest(), {"x": np.array([object()])})


def test_decode_frames_accepts_plain_bytes():
    frames = encode_frames(wire.HealthRequest(), {"x": np.arange(3, dtype=np.int32)})
    got = decode_frames([bytes(f) for f in frames])
    np.testing.assert_array_equal(got.arrays["x"], [0, 1, 2])


def test_bind_conflict_is_a_clear_error(pair):
    _, receiver = pair
    with pytest.raises(OSError, match="cannot bind"):
        Receiver(receiver.endpoint)


@pytest.fixture
def control():
    server = ControlServer(LOOPBACK)
    stop = threading.Event()
    calls: list[wire.Message] = []

    def handler(message, arrays):
        calls.append(message)
        if isinstance(message, wire.LoadWeightsRequest):
            if message.version < 0:
                raise ValueError(f"version={message.version} must be >= 0")
            return wire.ControlReply(ok=True, weight_version=message.version)
        if isinstance(message, wire.HealthRequest):
            return wire.HealthReply(ok=True, weight_version=1, model=str(sorted(arrays)))
        return wire.ControlReply(ok=True)

    thread = threading.Thread(target=server.serve_forever, args=(handler, stop), daemon=True)
    thread.start()
    client = ControlClient(server.endpoint, timeout_s=5.0)
    yield server, client, calls
    stop.set()
    thread.join(timeout=5)
    client.close()
    server.close()


def test_control_request_reply(control):
    _, client, calls = control
    assert client.request(wire.LoadWeightsRequest(path="/w", version=4)) == wire.ControlReply(ok=True, weight_version=4)
    reply = client.request(wire.HealthRequest(), {"a": np.zeros(2)})
    assert reply == wire.HealthReply(ok=True, weight_version=1, model="['a']")
    assert [type(c) for c in calls] == [wire.LoadWeightsRequest, wire.HealthRequest]


def test_handler_error_becomes_error_reply_and_server_survives(control):
    server, client, _ = control
    reply = client.request(wire.LoadWeightsRequest(path="/w", version=-1))
    assert isinstance(reply, wire.ControlReply) and not reply.ok
    assert "LoadWeightsRequest failed: ValueError: version=-1 must be >= 0" in reply.error
    assert client.request(wire.PauseRequest()) == wire.ControlReply(ok=True)
    assert server.num_rejected == 1


def test_malformed_and_other_version_requests_get_error_replies(control):
    server, client, calls = control
    raw = zmq.Context.instance().socket(zmq.REQ)
    raw.connect(server.endpoint)
    try:
        for bad in (b"garbage", msgspec.msgpack.encode((wire.SCHEMA_VERSION + 1, ["HealthRequest"], [], []))):
            raw.send(bad)
            assert raw.poll(5000)
            reply = wire.decode(raw.recv())
            assert isinstance(reply, wire.ControlReply) and not reply.ok and "refused request" in reply.error
        assert "schema version" in reply.error
    finally:
        raw.close(linger=0)
    assert calls == []  # the handler never saw a refused request
    assert client.request(wire.ResumeRequest()) == wire.ControlReply(ok=True)


def test_control_client_times_out_then_recovers():
    server = ControlServer(LOOPBACK)
    client = ControlClient(server.endpoint, timeout_s=0.2)
    try:
        with pytest.raises(TimeoutError, match=rf"no reply to HealthRequest from {server.endpoint} within 0.2s"):
            client.request(wire.HealthRequest())
        # The stale request reached the server; answer it so the REP socket is ready again.
        assert server.serve_once(lambda m, a: wire.ControlReply(ok=True), timeout_s=2)
        stop = threading.Event()
        thread = threading.Thread(
            target=server.serve_forever, args=(lambda m, a: wire.HealthReply(ok=True), stop), daemon=True
        )
        thread.start()
        # The reopened client socket works; the stale reply was dropped with the old socket.
        assert client.request(wire.HealthRequest(), timeout_s=5) == wire.HealthReply(ok=True)
        stop.set()
        thread.join(timeout=5)
    finally:
        client.close()
        server.close()


def _ask_in_thread(client: ControlClient) -> tuple[threading.Thread, list]:
    outcome: list = []

    def ask() -> None:
        try:
            outcome.append(client.request(wire.HealthRequest()))
        except Exception as e:
            outcome.append(e)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    return thread, outcome


def test_a_request_whose_server_goes_away_raises_peer_lost_at_once_not_after_the_timeout():
    """The bug: a server that died mid weight load cost the orchestrator its whole 600 s control timeout."""
    server = ControlServer(LOOPBACK)
    endpoint = server.endpoint
    client = ControlClient(endpoint, timeout_s=60.0, watch_peer=True)
    try:
        # a server that went away between two requests costs nothing: the next one goes to the new server
        thread = threading.Thread(target=server.serve_once, args=(lambda m, a: wire.HealthReply(ok=True), 5.0))
        thread.start()
        assert client.request(wire.HealthRequest(), timeout_s=5) == wire.HealthReply(ok=True)
        thread.join()
        server.close()
        time.sleep(0.2)
        server = ControlServer(endpoint)
        thread = threading.Thread(target=server.serve_once, args=(lambda m, a: wire.HealthReply(ok=True), 5.0))
        thread.start()
        assert client.request(wire.HealthRequest(), timeout_s=5) == wire.HealthReply(ok=True)
        thread.join()

        # the server takes the request and dies before replying: raised within a second, not in 60 s
        thread, outcome = _ask_in_thread(client)
        raw = server._socket
        assert raw.poll(5000, zmq.POLLIN)
        raw.recv_multipart()
        start = time.monotonic()
        server.close()
        thread.join(timeout=10)
        assert isinstance(outcome[0], PeerLostError), outcome
        assert time.monotonic() - start < 2.0
        assert endpoint in str(outcome[0]) and "HealthRequest" in str(outcome[0])

        # the reopened client reaches the server that comes back
        server = ControlServer(endpoint)
        thread = threading.Thread(target=server.serve_once, args=(lambda m, a: wire.HealthReply(ok=True), 5.0))
        thread.start()
        assert client.request(wire.HealthRequest(), timeout_s=5) == wire.HealthReply(ok=True)
        thread.join()
    finally:
        client.close()
        server.close()


def test_async_control_client(control):
    import asyncio

    from prime_rl.common.transport import AsyncControlClient

    server, _, calls = control

    async def main():
        client = AsyncControlClient(server.endpoint, timeout_s=5.0)
        try:
            replies = await asyncio.gather(
                *(client.request(wire.LoadWeightsRequest(path="/w", version=v)) for v in range(4))
            )
        finally:
            client.close()
        return replies

    replies = asyncio.run(main())
    assert sorted(r.weight_version for r in replies) == [0, 1, 2, 3]
    assert len(calls) == 4


def test_async_control_client_timeout():
    import asyncio

    from prime_rl.common.transport import AsyncControlClient

    server = ControlServer(LOOPBACK)

    async def main():
        client = AsyncControlClient(server.endpoint, timeout_s=0.2)
        try:
            with pytest.raises(TimeoutError, match=rf"{server.endpoint} within 0.2s"):
                await client.request(wire.HealthRequest())
        finally:
            client.close()

    try:
        asyncio.run(main())
    finally:
        server.close()


def test_sender_reuses_shared_frame_buffers_only_after_release(pair):
    sender, receiver = pair
    received = []
    for round_ in range(4):
        arrays = {f"a{i}": np.full(40_000, round_ * 10 + i, dtype=np.int32) for i in range(8)}  # 160 KB each
        # 10 x 64,000 B: each below ZERO_COPY_MIN_BYTES, together a 640 KB shared frame that
        # ZeroMQ sends without a copy, so the pool must wait for its release
        arrays.update({f"s{i}": np.full(16_000, round_, dtype=np.float32) for i in range(10)})
        sender.send(wire.HealthRequest(), arrays)
        received.append(receiver.recv())
        time.sleep(0.05)  # let ZeroMQ release the sent buffers
    for round_, got in enumerate(received):  # earlier messages are intact after buffer reuse
        assert all((got.arrays[f"s{i}"] == round_).all() for i in range(10))
        assert all((got.arrays[f"a{i}"] == round_ * 10 + i).all() for i in range(8))
    assert sender._pool.num_allocated == 1  # one shared frame per message, reused every round
