"""The closed control plane: run-secret sockets refuse peers without the secret (issue #17 probes)."""

import logging
import os
import stat
import threading
import time

import numpy as np
import pytest
import zmq

from prime_rl.common import wire
from prime_rl.common.auth import AuthError, RunSecret, is_loopback
from prime_rl.common.env import SECRET_FILE_ENV
from prime_rl.common.transport import ControlClient, ControlServer, Receiver, Sender

LOOPBACK = "tcp://127.0.0.1:0"


@pytest.fixture
def secret(tmp_path) -> RunSecret:
    return RunSecret.create(tmp_path / "control.secret")


def test_secret_file_is_private_and_stable(tmp_path):
    path = tmp_path / "run" / "control.secret"
    first = RunSecret.create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert RunSecret.create(path) == first  # a resumed run keeps its secret
    assert "run_id" in repr(first) and first.key.hex() not in repr(first)
    os.chmod(path, 0o644)
    with pytest.raises(AuthError, match="chmod 600"):
        RunSecret.load(path)


def test_binding_beyond_loopback_needs_a_secret(secret):
    assert is_loopback("tcp://127.0.0.1:5") and is_loopback("ipc:///tmp/x") and not is_loopback("tcp://0.0.0.0:5")
    with pytest.raises(PermissionError, match="without a run secret"):
        Receiver("tcp://0.0.0.0:0", secret=None)
    with Receiver("tcp://0.0.0.0:0", secret=secret) as receiver:
        assert receiver.endpoint.startswith("tcp://0.0.0.0:")


def test_authenticated_batch_round_trip_and_origin(secret):
    with Sender(LOOPBACK, bind=True, timeout_s=5.0, secret=secret) as sender:
        with Receiver(sender.endpoint, bind=False, timeout_s=5.0, secret=secret) as receiver:
            sender.send(wire.WeightsPublished(version=3), {"x": np.arange(100_000, dtype=np.float32)})
            got = receiver.recv()
            assert got.message == wire.WeightsPublished(version=3)
            assert got.arrays["x"][-1] == 99_999
            assert receiver.last_origin == "127.0.0.1"


@pytest.mark.chaos
@pytest.mark.parametrize("thief_secret", ["none", "other"])
def test_a_pull_socket_without_the_secret_cannot_steal_a_batch(secret, tmp_path, thief_secret):
    """Probe: a local PULL on the orchestrator's batch port took a batch and hung the run."""
    thief_key = None if thief_secret == "none" else RunSecret.create(tmp_path / "other.secret")
    with Sender(LOOPBACK, bind=True, timeout_s=0.5, secret=secret) as sender:
        with Receiver(sender.endpoint, bind=False, timeout_s=0.5, secret=thief_key) as thief:
            with pytest.raises(TimeoutError):  # no handshake with the thief, so nowhere to send
                sender.send(wire.WeightsPublished(version=1))
            with Receiver(sender.endpoint, bind=False, timeout_s=5.0, secret=secret) as trainer:
                sender.send(wire.WeightsPublished(version=1), timeout_s=5.0)
                assert trainer.recv().message.version == 1
            with pytest.raises(TimeoutError):
                thief.recv()


@pytest.mark.chaos
@pytest.mark.parametrize("client_secret", ["none", "other"])
def test_a_forged_control_request_never_reaches_the_handler(secret, tmp_path, client_secret, caplog):
    """Probe: an unauthenticated LoadWeightsRequest was accepted mid-run; later, a refused one left no log line.
    The refusal is logged once with its origin and reason, although the forger retried several times."""
    handled = []

    def handler(message, arrays):
        handled.append((message, server.last_origin))
        return wire.ControlReply(ok=True)

    stop = threading.Event()
    server = ControlServer(LOOPBACK, secret=secret)
    thread = threading.Thread(target=server.serve_forever, args=(handler, stop))
    thread.start()
    try:
        forger_key = None if client_secret == "none" else RunSecret.create(tmp_path / "other.secret")
        with caplog.at_level(logging.WARNING, logger="prime_rl.common.transport"):
            for _ in range(2):  # two attempts, one log line
                with ControlClient(server.endpoint, timeout_s=0.5, secret=forger_key) as forger:
                    with pytest.raises(TimeoutError):
                        forger.request(wire.LoadWeightsRequest(path="/tmp/evil", version=99))
                time.sleep(0.3)  # the server drains its monitor every poll (0.1 s)
        refused = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
        why = "has no run secret" if client_secret == "none" else "has a wrong run secret"
        assert len(refused) == 1, refused  # rate-limited: at most one line per origin per minute
        assert f"refused a connection to {server.endpoint} from 127.0.0.1:" in refused[0] and why in refused[0]
        assert server.refusals.num_refused >= 2
        with ControlClient(server.endpoint, timeout_s=5.0, secret=secret) as client:
            assert client.request(wire.PauseRequest(mode="keep")).ok
        assert [type(m).__name__ for m, _ in handled] == ["PauseRequest"]
        assert handled[0][1] == "127.0.0.1"
    finally:
        stop.set()
        thread.join()
        server.close()


def test_sockets_take_the_secret_from_the_environment(secret, tmp_path, monkeypatch):
    path = tmp_path / "control.secret"
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    with Receiver(LOOPBACK, timeout_s=5.0) as receiver:
        assert receiver.secret == secret
        with Sender(receiver.endpoint, timeout_s=5.0) as sender:
            sender.send(wire.WeightsPublished(version=2))
            assert receiver.recv().message.version == 2
        # A plain socket (another run, no secret) cannot deliver to it.
        with Sender(receiver.endpoint, timeout_s=0.5, secret=None) as plain:
            with pytest.raises(TimeoutError):
                plain.send(wire.WeightsPublished(version=5))


def test_curve_is_available():
    assert zmq.has("curve"), "pyzmq was built without CURVE (libsodium); the run secret cannot be enforced"


def test_http_key_for_job_scripts(secret, tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "prime_rl.common.auth", "--http-key", str(tmp_path / "control.secret")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == secret.http_api_key and len(secret.http_api_key) == 64
