"""The run secret: who may talk to a run's ZeroMQ sockets, and which run a server belongs to.

One random 32-byte secret per run lives in ``<run_dir>/control.secret`` (mode 0600, written once by the
launcher; a resumed run reuses it). Every process of the run finds it through the environment variable
``PRIME_RL_SECRET_FILE``, which the launcher sets for all of them, so the transport
(``prime_rl.common.transport``) authenticates every socket without each component passing it along.

Design decisions:
- ZeroMQ CURVE, keys derived from the secret. The side that binds is the CURVE server; its key pair and
  the clients' key pair are both derived (HMAC-SHA256) from the secret. A CURVE client must know the
  server's public key to even start the handshake, and that key is never written anywhere: only a
  process holding the secret can connect, so an unauthenticated PULL socket cannot take a batch (the
  PUSH side never completes a handshake with it) and a forged ``LoadWeightsRequest`` never arrives.
  Traffic is also encrypted, which matters once sockets leave loopback (multi-node).
- No ZAP handler: it would be one more thread per ZeroMQ context that blocks context termination,
  and the derived server key already keeps out every peer without the secret.
- ``run_id`` (a fingerprint of the secret, not the secret) is what a server reports in its health reply,
  so a launcher can refuse to call "ready" a server started by another run on the same port.
- Without a secret (a standalone ``inference`` server, unit tests) sockets are plain; the transport
  then refuses to bind anything but loopback, so an open control plane is never the silent default.

Measured (2 shared CPU cores, pyzmq 27.3 / libzmq 4.3.5, 2026-12-01): 64 MiB Sender -> Receiver
messages over loopback at 0.42 GB/s with CURVE, 1.28 GB/s plain: 0.1 s for a 40 MB step batch. Control
requests are a few hundred bytes; weights never travel over these sockets.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prime_rl.common.env import SECRET_FILE_ENV

if TYPE_CHECKING:
    import zmq

SECRET_FILE_NAME = "control.secret"
"""File name of the secret inside the run directory."""
SECRET_BYTES = 32


class AuthError(RuntimeError):
    """The run secret is missing, unreadable, or too open."""


@dataclass(frozen=True)
class RunSecret:
    """A run's shared secret and the CURVE keys derived from it."""

    key: bytes

    def __post_init__(self) -> None:
        if len(self.key) < 16:
            raise AuthError(f"run secret is {len(self.key)} bytes; it must be at least 16 (use RunSecret.create)")

    def __repr__(self) -> str:  # never print the secret itself
        return f"RunSecret(run_id={self.run_id})"

    def _derive(self, label: bytes) -> bytes:
        return hmac.new(self.key, b"prime-rl/" + label, hashlib.sha256).digest()

    @functools.cached_property
    def run_id(self) -> str:
        """A public fingerprint of the secret: equal run ids mean the same run."""
        return self._derive(b"run-id").hex()[:16]

    @functools.cached_property
    def http_api_key(self) -> str:
        """Bearer token for a run's HTTP APIs when they must listen beyond loopback (SLURM replicas)."""
        return self._derive(b"http-api-key").hex()

    def _keypair(self, label: bytes) -> tuple[bytes, bytes]:
        import zmq.utils.z85  # here, not at the top: config validation imports this module (`rl --help`)

        secret_key = zmq.utils.z85.encode(self._derive(label))
        return zmq.curve_public(secret_key), secret_key

    @functools.cached_property
    def server_keys(self) -> tuple[bytes, bytes]:
        """(public, secret) CURVE keys of every binding socket of the run (z85)."""
        return self._keypair(b"curve-server")

    @functools.cached_property
    def client_keys(self) -> tuple[bytes, bytes]:
        """(public, secret) CURVE keys of every connecting socket of the run (z85)."""
        return self._keypair(b"curve-client")

    def apply(self, socket: zmq.Socket, bind: bool) -> None:
        """Make ``socket`` a CURVE server (``bind``) or client of this run; call before bind/connect."""
        server_public, server_secret = self.server_keys
        if bind:
            socket.curve_server = True
            socket.curve_publickey = server_public
            socket.curve_secretkey = server_secret
        else:
            client_public, client_secret = self.client_keys
            socket.curve_serverkey = server_public
            socket.curve_publickey = client_public
            socket.curve_secretkey = client_secret

    # -- files ---------------------------------------------------------------------------------

    @classmethod
    def create(cls, path: str | os.PathLike[str]) -> RunSecret:
        """Load the secret at ``path``, or write a new random one there (mode 0600) if there is none."""
        path = Path(path)
        if path.exists():
            return cls.load(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(SECRET_BYTES) + "\n")
        try:
            os.link(tmp, path)  # fails if another launcher created it first: then both use that one
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        return cls.load(path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RunSecret:
        path = Path(path)
        try:
            mode = path.stat().st_mode
            text = path.read_text().strip()
        except OSError as e:
            raise AuthError(
                f"cannot read the run secret {path}: {e}; the launcher writes it as <run_dir>/{SECRET_FILE_NAME} "
                f"(or create one with `python -m prime_rl.common.auth {path}`)"
            ) from e
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise AuthError(
                f"run secret {path} has mode {stat.S_IMODE(mode):o}: anyone in its group or others may read it; "
                f"run `chmod 600 {path}`"
            )
        try:
            key = bytes.fromhex(text)
        except ValueError:
            raise AuthError(f"run secret {path} is not hex; delete it and let the launcher write a new one") from None
        return cls(key)

    @classmethod
    def from_env(cls) -> RunSecret | None:
        """The secret named by ``PRIME_RL_SECRET_FILE``, or None when it is unset."""
        path = os.environ.get(SECRET_FILE_ENV)
        return _load_cached(path) if path else None


@functools.lru_cache(maxsize=8)
def _load_cached(path: str) -> RunSecret:
    return RunSecret.load(path)


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``tcp://host:port`` endpoint) only accepts local connections."""
    if host.startswith(("ipc://", "inproc://")):
        return True
    if host.startswith("tcp://"):
        host = host.removeprefix("tcp://").rsplit(":", 1)[0]
    return host in LOOPBACK_HOSTS or host.startswith("127.")


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--http-key":  # for job scripts: export VLLM_API_KEY=$(...)
        print(RunSecret.load(sys.argv[2]).http_api_key)
    elif len(sys.argv) == 2:
        print(f"run secret in {sys.argv[1]} (run id {RunSecret.create(sys.argv[1]).run_id})")
    else:
        sys.exit(
            f"usage: python -m prime_rl.common.auth [--http-key] <secret-file>  (then export {SECRET_FILE_ENV}=<secret-file>)"
        )
