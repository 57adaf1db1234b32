"""The NIXL weight transport's metadata service: a tiny key-value store over ZeroMQ.

NIXL peers must load each other's agent metadata before a transfer. The trainer ranks and the
inference workers publish theirs here once per session (``<session>/trainer/<rank>``,
``<session>/infer/<agent>``, ``<session>/layout``) and read the others'; after that all traffic is
NIXL (data and versioned notifications), so the service is touched only at start-up.

Why our own: the ``modelexpress`` 0.7.0 wheel is only a client; its service is a Rust gRPC server
backed by Redis that is not on PyPI. This one is a ``ControlServer`` (REQ/REP, the wire envelope)
with a dict behind it, torch-free, started by the SLURM job on the trainer head node with
``python -m prime_rl.common.nixl_metadata --host 0.0.0.0 --port <weight_broadcast.port>``, or in
process by the trainer's rank 0 when nothing listens there yet.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time

import msgspec

from prime_rl.common.transport import ControlClient, ControlServer, ServerThread
from prime_rl.common.wire import (
    Message,
    MetadataGetRequest,
    MetadataListRequest,
    MetadataPutRequest,
    MetadataReply,
)

logger = logging.getLogger(__name__)


class MetadataStore:
    """The service's state and request handler (thread-safe: the server thread is its only caller)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def handle(self, request: Message, arrays: dict) -> MetadataReply:
        if isinstance(request, MetadataPutRequest):
            self.values[request.key] = request.value
            return MetadataReply(ok=True)
        if isinstance(request, MetadataGetRequest):
            return MetadataReply(ok=True, value=self.values.get(request.key))
        if isinstance(request, MetadataListRequest):
            return MetadataReply(ok=True, keys=sorted(k for k in self.values if k.startswith(request.prefix)))
        return MetadataReply(ok=False, error=f"{type(request).__name__} is not a metadata request")


class MetadataService(ServerThread):
    """Serves a ``MetadataStore`` on ``tcp://host:port`` in a background thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.store = MetadataStore()
        super().__init__(ControlServer(f"tcp://{host}:{port}"), self.store.handle, "prime-rl-nixl-metadata")
        self.port = int(self.endpoint.rsplit(":", 1)[1])


class MetadataClient:
    """Typed access to the service; ``wait_get`` polls until a peer has published its key."""

    def __init__(self, host: str, port: int, timeout_s: float = 30.0) -> None:
        self.endpoint = f"tcp://{host}:{port}"
        self._client = ControlClient(self.endpoint, timeout_s=timeout_s)

    def _request(self, request: Message) -> MetadataReply:
        try:
            reply = self._client.request(request)
        except TimeoutError as e:
            raise TimeoutError(
                f"NIXL metadata service at {self.endpoint} does not answer: {e}; start it with "
                "`python -m prime_rl.common.nixl_metadata --port <port>` or set weight_broadcast.host/port"
            ) from e
        if not isinstance(reply, MetadataReply) or not reply.ok:
            raise RuntimeError(f"NIXL metadata service at {self.endpoint} refused {type(request).__name__}: {reply}")
        return reply

    def put(self, key: str, value: bytes | msgspec.Struct) -> None:
        if not isinstance(value, bytes):
            value = msgspec.msgpack.encode(value)
        self._request(MetadataPutRequest(key=key, value=value))

    def get(self, key: str) -> bytes | None:
        return self._request(MetadataGetRequest(key=key)).value

    def keys(self, prefix: str) -> list[str]:
        return self._request(MetadataListRequest(prefix=prefix)).keys

    def wait_get(self, key: str, timeout_s: float, type_: type | None = None, poll_s: float = 0.05):
        """The value of ``key`` once it exists (decoded as ``type_`` when given); TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.get(key)
            if value is not None:
                return value if type_ is None else msgspec.msgpack.decode(value, type=type_)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"key {key!r} did not appear in the NIXL metadata service {self.endpoint} within {timeout_s}s; "
                    "is the peer that publishes it running and pointed at the same service and session?"
                )
            time.sleep(poll_s)

    def close(self) -> None:
        self._client.close()


def is_serving(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether a metadata service answers at ``host:port``."""
    client = ControlClient(f"tcp://{host}:{port}", timeout_s=timeout_s)
    try:
        return isinstance(client.request(MetadataListRequest(prefix="")), MetadataReply)
    except TimeoutError:
        return False
    finally:
        client.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m prime_rl.common.nixl_metadata", description="NIXL weight-transfer metadata service"
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=29710, help="port to listen on (weight_broadcast.port)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    service = MetadataService(args.host, args.port).start()
    logger.info("NIXL metadata service on %s", service.endpoint)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
    service.stop()


if __name__ == "__main__":
    main()
