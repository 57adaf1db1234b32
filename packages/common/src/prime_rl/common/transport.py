"""ZeroMQ transport for wire messages: a msgpack header frame plus one zero-copy frame per array.

A message on the wire is the multipart ``[envelope, array_0, array_1, ...]`` where the envelope is
``wire.encode_header(message, specs)`` and ``specs[k]`` (name, dtype, shape) describes ``array_k``.

- ``Sender`` / ``Receiver``: PUSH / PULL for batches (orchestrator -> trainer rank). Either side may
  bind; by default the receiver binds (a trainer rank owns its endpoint) and the sender connects.
- ``ControlClient`` / ``ControlServer``: REQ / REP for control requests (pause, load weights, ...);
  ``AsyncControlClient`` is the same client for asyncio code.

Design decisions:
- Zero copy both ways: arrays are handed to ZeroMQ with ``copy=False`` (do not mutate an array until
  the next send returns), and received arrays are ``np.frombuffer`` views over the received frames.
- Every send and receive has a timeout (``None`` waits forever) and raises ``TimeoutError`` naming the
  endpoint and the timeout. The sender sets ZMQ_IMMEDIATE so "no receiver connected" is a timeout
  instead of a message silently parked in a queue.
- A malformed message or one with another schema version never kills a receiver: ``Receiver`` logs
  it, counts it in ``num_rejected`` and waits for the next one; ``ControlServer`` answers it with
  ``ControlReply(ok=False, error=...)``. A handler exception is also turned into an error reply.
- ``ControlClient`` follows ZeroMQ's "lazy pirate" pattern: after a timeout the REQ socket is
  stuck mid-exchange, so it is closed and reopened.

- Closed by default: every socket of a run authenticates with the run secret (``prime_rl.common.auth``:
  ZeroMQ CURVE, keys derived from ``PRIME_RL_SECRET_FILE``, which the launcher sets). Without a secret
  a socket may only bind loopback; binding another interface without one is refused. Receivers and
  control servers record the peer address of the last message (``last_origin``) so handlers can log
  who asked for a weight load or a pause. A control server logs the peers it refused for want of the
  secret (``prime_rl.common.refusals``), one line per origin per minute at most.

Left out: an asyncio server and receiver (run a ``ControlServer`` in a ``ServerThread`` / ``Receiver.recv`` in a
thread).
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Self

import numpy as np
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from prime_rl.common.auth import RunSecret, is_loopback
from prime_rl.common.env import SECRET_FILE_ENV
from prime_rl.common.refusals import RefusalLog
from prime_rl.common.wire import (
    MESSAGE_TYPES,
    ControlReply,
    Message,
    TensorSpec,
    WireError,
    decode_header,
    encode_header,
)

logger = logging.getLogger(__name__)

_BYTE_FREE_DTYPES = ("O", "V", "U", "S", "M", "m")  # kinds numpy cannot rebuild safely from raw bytes


class _Unset(enum.Enum):
    UNSET = 0


_UNSET = _Unset.UNSET  # "use the default": the instance's timeout_s, the environment's run secret (None means none)

Arrays = Mapping[str, np.ndarray]
"""Named arrays that travel beside a message as extra frames (zero-copy)."""
CallTimeout = float | None | _Unset
"""One call's ``timeout_s``: seconds, None to wait forever, or ``_UNSET`` (left out) for the instance's ``timeout_s``;
one alias so that every send, receive and request states the rule the same way (``_timeout`` applies it)."""


class Received(NamedTuple):
    """A received message and its arrays (views over the received frames, no copy)."""

    message: Message
    arrays: dict[str, np.ndarray]


def _ms(timeout_s: float | None) -> int:
    return -1 if timeout_s is None else max(0, int(timeout_s * 1000))


ZERO_COPY_MIN_BYTES = 64 * 1024
"""Arrays this large get their own zero-copy frame; smaller ones share a frame (pyzmq copies small frames anyway)."""
SHARED_FRAME_MAX_BYTES = 4 << 20
"""Start a new shared frame beyond this size."""
ALIGN = 64
"""Byte alignment of each array inside a shared frame (so the received views are aligned)."""


def _checked(name: str, array: np.ndarray) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype.kind in _BYTE_FREE_DTYPES:
        raise TypeError(f"array {name!r} has dtype {array.dtype}; only numeric and bool arrays can be sent as frames")
    if not array.flags.c_contiguous:
        array = array.copy(order="C")  # pass C-contiguous arrays to keep large ones zero-copy
    return array


class BufferPool:
    """Reusable shared-frame buffers: fresh pages cost a page fault each, which dominated the copy.

    A buffer returns to the pool only once ZeroMQ has released it (its send was tracked).
    """

    def __init__(self, max_free: int = 64) -> None:
        self.max_free = max_free
        self._free: list[np.ndarray] = []
        self._in_flight: list[tuple[list[np.ndarray], zmq.MessageTracker]] = []
        self.num_allocated = 0
        """Pooled buffers allocated so far (stays flat in steady state)."""

    def get(self, size: int) -> np.ndarray:
        """A uint8 buffer of exactly ``size`` bytes (a view of a pooled ``SHARED_FRAME_MAX_BYTES`` one)."""
        if size > SHARED_FRAME_MAX_BYTES:
            return np.empty(size, dtype=np.uint8)
        self._reap()
        if self._free:
            base = self._free.pop()
        else:
            base = np.empty(SHARED_FRAME_MAX_BYTES, dtype=np.uint8)
            self.num_allocated += 1
        return base[:size]

    def track(self, buffers: list[np.ndarray], tracker: zmq.MessageTracker) -> None:
        """Return ``buffers`` to the pool once ``tracker`` says ZeroMQ is done with them."""
        self._in_flight.append(([b.base if b.base is not None else b for b in buffers], tracker))

    def _reap(self) -> None:
        still = []
        for buffers, tracker in self._in_flight:
            if tracker.done:
                room = self.max_free - len(self._free)
                self._free.extend(b for b in buffers[:room] if b.nbytes == SHARED_FRAME_MAX_BYTES)
            else:
                still.append((buffers, tracker))
        self._in_flight = still


def encode_frames(
    message: Message,
    arrays: Arrays | None = None,
    allocate: Callable[[int], np.ndarray] | None = None,
) -> list[bytes | memoryview]:
    """Multipart frames for ``message`` and its named arrays.

    Arrays of at least ``ZERO_COPY_MIN_BYTES`` become frames of their own without a copy. Smaller
    ones are copied into shared frames: thousands of tiny frames cost far more per byte than one
    memcpy (measured: 9,640 frames of 8-32 KiB ran at a quarter of the coalesced throughput).
    ``allocate(size)`` provides the shared frames' uint8 buffers (default: fresh ``np.empty``).
    """
    specs: list[TensorSpec] = []
    placements: list[tuple[int, int]] = []
    frames: list[memoryview | None] = []
    shared: list[tuple[int, np.ndarray]] = []  # (offset, array) in the open shared frame
    shared_index, shared_size = -1, 0

    def close_shared() -> None:
        buffer = allocate(shared_size) if allocate else np.empty(shared_size, dtype=np.uint8)
        for offset, small in shared:
            buffer[offset : offset + small.nbytes] = small.reshape(-1).view(np.uint8)
        frames[shared_index] = memoryview(buffer)
        shared.clear()

    for name, value in (arrays or {}).items():
        array = _checked(name, value)
        specs.append(TensorSpec.of(name, array))
        if array.nbytes >= ZERO_COPY_MIN_BYTES:
            placements.append((len(frames), 0))
            frames.append(memoryview(array.reshape(-1).view(np.uint8)))  # flat byte view, no copy
            continue
        offset = -shared_size % ALIGN + shared_size
        if shared_index < 0 or offset + array.nbytes > SHARED_FRAME_MAX_BYTES:
            if shared_index >= 0:
                close_shared()
            shared_index, offset = len(frames), 0
            frames.append(None)  # filled by close_shared
        shared.append((offset, array))
        shared_size = offset + array.nbytes
        placements.append((shared_index, offset))
    if shared_index >= 0:
        close_shared()
    return [encode_header(message, specs, placements), *frames]  # type: ignore[list-item]


@functools.lru_cache(maxsize=64)
def _dtype(name: str) -> np.dtype | None:
    try:
        dtype = np.dtype(name)
    except TypeError:
        return None
    return None if dtype.kind in _BYTE_FREE_DTYPES else dtype


def _view(spec: TensorSpec, buffer: memoryview, offset: int) -> np.ndarray:
    """A read-only array over ``buffer[offset:]`` as ``spec`` describes it; WireError if it does not fit."""
    dtype = _dtype(spec.dtype)
    if dtype is None:
        raise WireError(f"array {spec.name!r}: dtype {spec.dtype!r} cannot be rebuilt from raw bytes")
    shape = spec.shape
    if shape and min(shape) < 0:
        raise WireError(f"array {spec.name!r}: negative dimension in shape {shape}")
    count = math.prod(shape)
    if offset < 0 or offset % dtype.itemsize or offset + count * dtype.itemsize > buffer.nbytes:
        raise WireError(
            f"array {spec.name!r}: {spec.dtype}{shape} at byte {offset} does not fit its {buffer.nbytes}-byte frame"
        )
    if count == 0:
        array = np.empty(shape, dtype=dtype)
    else:
        array = np.frombuffer(buffer, dtype=dtype, count=count, offset=offset)
        if len(shape) != 1:
            array = array.reshape(shape)
    # Writable when the frame is (a received zmq.Frame is ours alone): torch.from_numpy warns on
    # read-only arrays, and the trainer may normalize in place.
    return array


def decode_frames(frames: Sequence[zmq.Frame | bytes], types: Sequence[type[Message]] = MESSAGE_TYPES) -> Received:
    """Inverse of ``encode_frames``; raises ``WireError`` (or ``SchemaVersionError``) on any mismatch."""
    if not frames:
        raise WireError("empty multipart message")
    buffers = [memoryview(f) for f in frames]  # zmq.Frame exports its bytes without a copy
    message, specs, placements = decode_header(buffers[0], types)
    data = buffers[1:]
    num_frames = max((index for index, _ in placements), default=-1) + 1
    if num_frames != len(data) or min((index for index, _ in placements), default=0) < 0:
        raise WireError(
            f"{type(message).__name__}: header places arrays in {num_frames} frames but {len(data)} arrived"
        )
    arrays: dict[str, np.ndarray] = {}
    for spec, (index, offset) in zip(specs, placements):
        if spec.name in arrays:
            raise WireError(f"array name {spec.name!r} appears twice in one message")
        arrays[spec.name] = _view(spec, data[index], offset)
    return Received(message, arrays)


def _timeout(timeout_s: CallTimeout, default: float | None) -> float | None:
    """A call's ``timeout_s``: the instance's ``default`` unless the call names one (None: wait forever)."""
    return default if timeout_s is _UNSET else timeout_s


def _no_reply(message: Message, endpoint: str, timeout: float | None) -> TimeoutError:
    """The error of a control request that got no reply (sync and asyncio clients alike)."""
    return TimeoutError(
        f"no reply to {type(message).__name__} from {endpoint} within {timeout}s; is the server running there?"
    )


def _resolve_secret(secret: RunSecret | None | _Unset) -> RunSecret | None:
    return RunSecret.from_env() if secret is _UNSET else secret


def check_bind_allowed(endpoint: str, secret: RunSecret | None) -> None:
    """Refuse to bind a non-loopback endpoint without a run secret (anyone on the network could use it)."""
    if secret is None and not is_loopback(endpoint):
        raise PermissionError(
            f"refusing to bind {endpoint} without a run secret: anyone who can reach it could load weights, "
            f"pause inference or take batches; bind 127.0.0.1, or set {SECRET_FILE_ENV} to a secret file "
            "(`python -m prime_rl.common.auth <file>`; the launcher does this for a run)"
        )


def frame_origin(frame: zmq.Frame) -> str:
    """The peer address a received frame came from ("?" when the transport does not say, e.g. inproc)."""
    try:
        return frame.get("Peer-Address") or "?"
    except (zmq.ZMQError, AttributeError, TypeError):
        return "?"


class _Socket:
    """A ZeroMQ socket with an endpoint, bind-or-connect, run authentication, and context-manager closing."""

    def __init__(
        self,
        kind: int,
        endpoint: str,
        bind: bool,
        context: zmq.Context | None,
        linger_s: float,
        secret: RunSecret | None | _Unset = _UNSET,
    ) -> None:
        self.endpoint = endpoint
        self.bind = bind
        self.secret = _resolve_secret(secret)
        """The run secret this socket authenticates with (None: plain, loopback-only when binding)."""
        self.last_origin = "?"
        """Peer address of the last message received."""
        if bind:
            check_bind_allowed(endpoint, self.secret)
        self._kind = kind
        self._context = context or zmq.Context.instance()
        self._linger_ms = _ms(linger_s)
        self._socket = self._open()

    def _configure(self, socket: zmq.Socket) -> None:
        """Hook for socket options that must be set before bind/connect."""

    def _open(self) -> zmq.Socket:
        socket = self._context.socket(self._kind)
        socket.setsockopt(zmq.LINGER, self._linger_ms)
        if self.secret is not None:
            self.secret.apply(socket, self.bind)
        self._configure(socket)
        try:
            if self.bind:
                socket.bind(self.endpoint)
                # With "tcp://host:0" ZeroMQ picks a free port; expose the real one.
                self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                socket.connect(self.endpoint)
        except zmq.ZMQError as e:
            socket.close(linger=0)
            verb = "bind" if self.bind else "connect"
            raise OSError(f"cannot {verb} {self.endpoint!r}: {e}; pick a free port / a valid endpoint") from e
        return socket

    def close(self) -> None:
        self._socket.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Sender(_Socket):
    """PUSH side: ``send(message, arrays)``. Connects by default.

    Without a connected peer a send blocks (and times out after ``timeout_s``): a batch must reach a live
    trainer. ``queue_without_peer`` queues instead (up to the high-water mark, 1000 messages), for
    notifications whose reader may come later or be gone for good: the trainer's version announcements
    outlive an orchestrator that already took its last step."""

    def __init__(
        self,
        endpoint: str,
        *,
        bind: bool = False,
        timeout_s: float | None = 60.0,
        context: zmq.Context | None = None,
        linger_s: float = 5.0,
        secret: RunSecret | None | _Unset = _UNSET,
        queue_without_peer: bool = False,
    ) -> None:
        self.timeout_s = timeout_s
        self.queue_without_peer = queue_without_peer
        self._pool = BufferPool()
        super().__init__(zmq.PUSH, endpoint, bind, context, linger_s, secret)

    def _configure(self, socket: zmq.Socket) -> None:
        if not self.queue_without_peer:
            socket.setsockopt(zmq.IMMEDIATE, 1)  # no peer => block (and time out), don't queue blindly

    def send(self, message: Message, arrays: Arrays | None = None, timeout_s: CallTimeout = _UNSET) -> None:
        """Send ``message`` with ``arrays``; raise ``TimeoutError`` if no peer takes it in time.

        Large arrays are not copied: ZeroMQ's I/O thread reads them after ``send`` returns, so do not
        modify them in place afterwards (build fresh arrays per batch). The message is queued, not
        necessarily delivered, when ``send`` returns.
        """
        timeout = _timeout(timeout_s, self.timeout_s)
        pooled: list[np.ndarray] = []

        def allocate(size: int) -> np.ndarray:
            pooled.append(self._pool.get(size))
            return pooled[-1]

        frames = encode_frames(message, arrays, allocate)
        if not self._socket.poll(_ms(timeout), zmq.POLLOUT):
            raise TimeoutError(
                f"send of {type(message).__name__} to {self.endpoint} timed out after {timeout}s: "
                "no receiver is connected or its queue is full; start the receiver or raise timeout_s"
            )
        if not pooled:
            self._socket.send_multipart(frames, copy=False)
            return
        # ZeroMQ takes a multipart message atomically once the first frame is accepted; frames are
        # sent one by one only to get a tracker per pooled buffer (pyzmq returns the last one only).
        pooled_ids = {id(b) for b in pooled}
        for i, frame in enumerate(frames):
            more = zmq.SNDMORE if i < len(frames) - 1 else 0
            is_pooled = isinstance(frame, memoryview) and id(frame.obj) in pooled_ids
            tracker = self._socket.send(frame, more, copy=False, track=is_pooled)
            if is_pooled:
                self._pool.track([frame.obj], tracker)


class Receiver(_Socket):
    """PULL side: ``recv() -> Received``. Binds by default. Refused messages are logged and skipped."""

    def __init__(
        self,
        endpoint: str,
        *,
        bind: bool = True,
        timeout_s: float | None = None,
        types: Sequence[type[Message]] = MESSAGE_TYPES,
        context: zmq.Context | None = None,
        linger_s: float = 0.0,
        secret: RunSecret | None | _Unset = _UNSET,
    ) -> None:
        self.timeout_s = timeout_s
        self.types = tuple(types)
        self.num_rejected = 0
        """Messages refused so far (malformed, other schema version)."""
        self.last_error: str | None = None
        """Why the last refused message was refused."""
        super().__init__(zmq.PULL, endpoint, bind, context, linger_s, secret)

    def recv(self, timeout_s: CallTimeout = _UNSET) -> Received:
        """Next well-formed message; raises ``TimeoutError`` when none arrives within the timeout."""
        timeout = _timeout(timeout_s, self.timeout_s)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._socket.poll(_ms(remaining), zmq.POLLIN):
                raise TimeoutError(
                    f"no message on {self.endpoint} within {timeout}s; is the sender running and connected here?"
                )
            frames = self._socket.recv_multipart(copy=False)
            self.last_origin = frame_origin(frames[0])
            try:
                return decode_frames(frames, self.types)
            except WireError as e:
                self.num_rejected += 1
                self.last_error = str(e)
                logger.error("refused a message on %s from %s: %s", self.endpoint, self.last_origin, e)


Handler = Callable[[Message, dict[str, np.ndarray]], Message]
"""A control handler: (request, arrays) -> reply message."""


class ControlServer(_Socket):
    """REP side of control requests. Every request gets exactly one reply, errors included."""

    def __init__(
        self,
        endpoint: str,
        *,
        bind: bool = True,
        types: Sequence[type[Message]] = MESSAGE_TYPES,
        context: zmq.Context | None = None,
        linger_s: float = 1.0,
        secret: RunSecret | None | _Unset = _UNSET,
    ) -> None:
        self.types = tuple(types)
        self.num_rejected = 0
        """Requests refused (malformed, other schema version) or whose handler raised."""
        super().__init__(zmq.REP, endpoint, bind, context, linger_s, secret)
        self.refusals = RefusalLog(self._socket, self.endpoint) if self.secret is not None and bind else None
        """Logs peers refused for want of the run secret (they never reach a handler)."""

    def serve_once(self, handler: Handler, timeout_s: float | None = None) -> bool:
        """Handle one request if one arrives within ``timeout_s``; return whether one was handled."""
        if self.refusals is not None:
            self.refusals.drain()
        if not self._socket.poll(_ms(timeout_s), zmq.POLLIN):
            return False
        frames = self._socket.recv_multipart(copy=False)
        self.last_origin = frame_origin(frames[0])  # read by handlers to log who asked
        try:
            request = decode_frames(frames, self.types)
        except WireError as e:
            self.num_rejected += 1
            logger.error("refused a control request on %s from %s: %s", self.endpoint, self.last_origin, e)
            reply: Message = ControlReply(ok=False, error=f"refused request: {e}")
        else:
            try:
                reply = handler(request.message, request.arrays)
            except Exception as e:  # the server must outlive a failing handler; the client gets the reason
                self.num_rejected += 1
                logger.exception("control handler failed on %s for %s", self.endpoint, type(request.message).__name__)
                reply = ControlReply(
                    ok=False, error=f"{type(request.message).__name__} failed: {type(e).__name__}: {e}"
                )
        self._socket.send_multipart(encode_frames(reply), copy=False)
        return True

    def close(self) -> None:
        if self.refusals is not None:
            self._socket.disable_monitor()
            self.refusals.close()
        super().close()

    def serve_forever(self, handler: Handler, stop: threading.Event, poll_s: float = 0.1) -> None:
        """Serve until ``stop`` is set (checked every ``poll_s``)."""
        while not stop.is_set():
            self.serve_once(handler, timeout_s=poll_s)


class ServerThread:
    """Serves ``server`` with ``handler`` in a daemon thread from ``start`` until ``stop``, then closes it."""

    def __init__(self, server: ControlServer, handler: Handler, name: str) -> None:
        self.server = server
        self.endpoint = server.endpoint
        self._handler = handler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        try:
            self.server.serve_forever(self._handler, self._stop)
        finally:
            self.server.close()

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class PeerLostError(ConnectionError):
    """The connection that carried a control request closed before the reply came: the server went away."""


class ControlClient(_Socket):
    """REQ side: ``request(message) -> reply``. Reopens its socket after a timeout (lazy pirate).

    With ``watch_peer``, a request whose connection closes before its reply raises ``PeerLostError`` at once
    instead of waiting out the timeout: a REQ socket reconnects by itself but never sends a request again, so a
    server that died while handling one (a weight load) would otherwise cost the whole timeout. A socket monitor
    tells a drop of the connection that carries the request (one whose handshake had succeeded) from refused or
    failed connection attempts, which lose nothing (the request waits in the queue for the next connection).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float | None = 60.0,
        types: Sequence[type[Message]] = MESSAGE_TYPES,
        context: zmq.Context | None = None,
        secret: RunSecret | None | _Unset = _UNSET,
        watch_peer: bool = False,
    ) -> None:
        self.timeout_s = timeout_s
        self.types = tuple(types)
        self.watch_peer = watch_peer
        self._monitor: zmq.Socket | None = None
        self._connected = False
        self._ever_connected = False
        super().__init__(zmq.REQ, endpoint, False, context, 0.0, secret)

    def _configure(self, socket: zmq.Socket) -> None:
        if self.watch_peer:  # before connect: the first handshake must not be missed
            self._monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            self._connected = False

    @property
    def peer_gone(self) -> bool:
        """With ``watch_peer``: the server this client was connected to went away and nothing has answered the
        handshake since, so a request now would wait in the queue for a restart (False before the first connection:
        one is being made)."""
        self._peer_dropped()
        return self._ever_connected and not self._connected

    def _peer_dropped(self) -> bool:
        """Read the pending monitor events; True if an established connection closed among them."""
        dropped = False
        while self._monitor is not None and self._monitor.poll(0, zmq.POLLIN):
            event = parse_monitor_message(self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected = self._ever_connected = True
            elif event == zmq.EVENT_DISCONNECTED and self._connected:
                self._connected, dropped = False, True
        return dropped

    def _wait_reply(self, message: Message, timeout: float | None, deadline: float | None) -> None:
        """Until the reply is readable; ``TimeoutError`` past ``deadline``, ``PeerLostError`` on a dropped peer."""
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = dict(poller.poll(_ms(remaining)))
            if self._socket in ready:
                return
            if self._monitor in ready and self._peer_dropped():
                self._reopen()
                raise PeerLostError(
                    f"the connection to {self.endpoint} closed before the reply to {type(message).__name__}: "
                    "the server went away while handling it"
                )
            if not ready:
                self._reopen()
                raise _no_reply(message, self.endpoint, timeout)

    def request(self, message: Message, arrays: Arrays | None = None, timeout_s: CallTimeout = _UNSET) -> Message:
        """Send a request and wait for its reply; ``TimeoutError`` if the server does not answer in time."""
        timeout = _timeout(timeout_s, self.timeout_s)
        deadline = None if timeout is None else time.monotonic() + timeout
        frames = encode_frames(message, arrays)
        if not self._socket.poll(_ms(timeout), zmq.POLLOUT):
            self._reopen()
            raise TimeoutError(
                f"control request {type(message).__name__} to {self.endpoint} not sent within {timeout}s"
            )
        self._peer_dropped()  # a drop before this request lost nothing
        self._socket.send_multipart(frames, copy=False)
        self._wait_reply(message, timeout, deadline)
        return decode_frames(self._socket.recv_multipart(copy=False), self.types).message

    def _reopen(self) -> None:
        self._close_monitor()
        self._socket.close(linger=0)
        self._socket = self._open()

    def _close_monitor(self) -> None:
        if self._monitor is not None:
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None

    def close(self) -> None:
        self._close_monitor()
        super().close()


class AsyncControlClient:
    """asyncio REQ side for event-loop code (the orchestrator): ``await request(message) -> reply``.

    Concurrent callers are serialized (a REQ socket holds one request at a time); after a timeout
    the socket is reopened, as in ``ControlClient``.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float | None = 60.0,
        types: Sequence[type[Message]] = MESSAGE_TYPES,
        context: zmq.asyncio.Context | None = None,
        secret: RunSecret | None | _Unset = _UNSET,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.types = tuple(types)
        self.secret = _resolve_secret(secret)
        self._context = context or zmq.asyncio.Context.instance()
        self._lock = asyncio.Lock()
        self._socket = self._open()

    def _open(self) -> zmq.asyncio.Socket:
        socket = self._context.socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        if self.secret is not None:
            self.secret.apply(socket, bind=False)
        socket.connect(self.endpoint)
        return socket

    async def request(self, message: Message, arrays: Arrays | None = None, timeout_s: CallTimeout = _UNSET) -> Message:
        """Send a request and await its reply; ``TimeoutError`` if none arrives within the timeout."""
        timeout = _timeout(timeout_s, self.timeout_s)
        frames = encode_frames(message, arrays)
        async with self._lock:
            try:
                async with asyncio.timeout(timeout):
                    await self._socket.send_multipart(frames, copy=False)
                    reply = await self._socket.recv_multipart(copy=False)
            except TimeoutError:
                self._socket.close(linger=0)
                self._socket = self._open()
                raise _no_reply(message, self.endpoint, timeout) from None
        return decode_frames(reply, self.types).message

    def close(self) -> None:
        self._socket.close()
