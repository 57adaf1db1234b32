"""Log the peers a run's socket refused: no run secret, or a wrong one.

A peer without the run secret never gets a message through (``prime_rl.common.auth``: CURVE keys derived
from it), so no handler ever sees it; without this module such attempts left no trace. A ZeroMQ socket
monitor reports each failed handshake; ``RefusalLog.drain`` turns them into log lines, one per origin at
most every ``interval_s`` (a client with a wrong secret reconnects every 100 ms), with the count of the
refusals folded into it.

Design decisions:
- No thread: the owner (``ControlServer.serve_once``) polls the monitor socket with its own and drains it.
- The origin is best effort. ZeroMQ's stable monitor events carry the listening endpoint, not the peer's
  (libzmq 4.3 has the peer only in its draft API), and the accepted fd is closed by the time the event is
  read. The kernel still lists the closed connection (TIME_WAIT, 60 s) in ``/proc/net/tcp``: the peers of
  connections to our port that ended since the last drain are named; "?" where that cannot be read
  (not Linux, ipc://). Closed connections are re-read at least once a second and those closed in the
  last 2 s are named, so a legitimate client whose connection closed in that window is named beside it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import zmq
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger("prime_rl.common.transport")

_REFUSED_EVENTS = {
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication failed",
}
_WHY = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "the peer has no run secret",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "the peer has a wrong run secret",
}
_TCP_LISTEN, _TCP_ESTABLISHED = "0A", "01"


def _hex_ip(text: str) -> str:
    """An address from /proc/net/tcp{,6} (32-bit words in host (little-endian) order) as text."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return ".".join(str(b) for b in words)
    if words[:12] == b"\0" * 10 + b"\xff\xff":  # IPv4-mapped
        return ".".join(str(b) for b in words[12:])
    return ":".join(words[i : i + 2].hex() for i in range(0, 16, 2))


def ended_peers(port: int, proc_net: Path = Path("/proc/net")) -> set[str]:
    """Each ``ip:port`` peer whose connection to local ``port`` is closing or closed (not listening, not open)."""
    peers = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc_net / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state = fields[1], fields[2], fields[3]
            if int(local.rsplit(":", 1)[1], 16) != port or state in (_TCP_LISTEN, _TCP_ESTABLISHED):
                continue
            ip, remote_port = remote.rsplit(":", 1)
            peers.add(f"{_hex_ip(ip)}:{int(remote_port, 16)}")
    return peers


class RefusalLog:
    """Watches ``socket`` (bound to ``endpoint``) for refused handshakes; ``drain`` logs them."""

    def __init__(self, socket: zmq.Socket, endpoint: str, interval_s: float = 60.0) -> None:
        self.endpoint = endpoint
        self.interval_s = interval_s
        self.num_refused = 0
        """Handshakes refused since the socket was bound."""
        # Not EVENT_HANDSHAKE_FAILED_NO_DETAIL: any peer that hangs up mid-handshake (a port probe, a client
        # closing early) raises it. A peer without the secret fails the protocol (no CURVE: mechanism
        # mismatch; another secret: cryptographic error).
        self.monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        self._port = int(endpoint.rsplit(":", 1)[1]) if endpoint.startswith("tcp://") else None
        self._seen: dict[str, float] = {}
        """Closed connections to our port -> when first seen (monotonic)."""
        self._scanned = -float("inf")
        self._scan()
        self._last_logged: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def _scan(self) -> None:
        now = time.monotonic()
        ended = ended_peers(self._port) if self._port is not None else set()
        self._seen = {peer: self._seen.get(peer, now) for peer in ended}
        self._scanned = now

    def drain(self) -> None:
        """Log the refusals the monitor reported since the last call (never blocks)."""
        reasons = []
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())
            if event["event"] in _REFUSED_EVENTS:
                reasons.append(_WHY.get(event["value"], _REFUSED_EVENTS[event["event"]]))
        if not reasons:
            if time.monotonic() - self._scanned > 1.0:  # so a legitimate close long ago is not named later
                self._scan()
            return
        self.num_refused += len(reasons)
        self._scan()
        now = time.monotonic()
        # Closed within the last 2 s: the refused peer's connection closed before its event was read.
        recent = sorted(peer for peer, seen in self._seen.items() if now - seen < 2.0)
        hosts = sorted({peer.rsplit(":", 1)[0] for peer in recent}) or ["?"]
        for host in hosts:
            self._suppressed[host] = self._suppressed.get(host, 0) + len(reasons)
            last = max(self._last_logged.values(), default=-float("inf")) if host == "?" else None
            if now - (last if last is not None else self._last_logged.get(host, -float("inf"))) < self.interval_s:
                continue  # an unknown origin is folded into the lines of known ones
            peers = ", ".join(p for p in recent if p.startswith(host + ":")) or host
            logger.warning(
                "refused a connection to %s from %s: %s (%d refused from %s since the last such line; at most one "
                "line per %.0fs)",
                self.endpoint,
                peers,
                "; ".join(sorted(set(reasons))),
                self._suppressed.pop(host),
                host,
                self.interval_s,
            )
            self._last_logged[host] = now

    def close(self) -> None:
        self.monitor.close(linger=0)
