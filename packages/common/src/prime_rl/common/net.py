"""Local networking helpers shared by launchers, trainers, tests and benchmarks."""

import fcntl
import hashlib
import os
import random
import socket
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path


def free_port(host: str = "127.0.0.1", headroom: int = 0) -> int:
    """A TCP port free on `host` right now, for a caller that binds it itself a moment later.

    It comes from the reserved range (`reserve_ports`), not from ``bind(0)``: the kernel hands ephemeral ports
    to any process's outgoing connections, and one did take a port between this call and the bind (a ZeroMQ
    client's source port; CI's orchestrator tests, issue 35). The port stays locked for this process's next
    `_RECENT_KEEP` calls, so no other caller of `free_port` or `reserve_ports` picks it before it is bound.
    ``headroom``: the caller derives ports up to that far above this one (an inference server's control ports
    at +100), so the port is at most ``65535 - headroom`` (the reserved range ends at 65535). Falls back to
    ``bind(0)`` when the lock directory cannot be used."""
    low, high = reserved_port_range()
    try:
        lease = reserve_ports(1, key=f"{os.getpid()}-{random.random()}", host=host, span=(low, high - headroom))
    except (OSError, RuntimeError):
        return _ephemeral_port(host, headroom)
    with _RECENT_LOCK:
        _RECENT.append(lease)
        if len(_RECENT) > _RECENT_KEEP:
            _RECENT.popleft().release()
    return lease.base


def _ephemeral_port(host: str, headroom: int, tries: int = 64) -> int:
    """``free_port``'s fallback: a ``bind(0)`` port at most ``65535 - headroom`` (the kernel's ephemeral range
    usually ends at 60999, so only a large headroom needs another try)."""
    for _ in range(tries):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port + headroom <= 65535:
            return port
    raise RuntimeError(
        f"no free port at or below {65535 - headroom} on {host} from the kernel's ephemeral range after {tries} "
        f"tries (headroom {headroom}); lower the ports derived from it or make {PORT_LOCK_DIR} usable"
    )


def free_port_range(count: int, low: int, high: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive ports in [low, high) that all bind on `host` right now (tests pick
    ranges below Linux's ephemeral range, 32768+, and apart from each other: a port derived from an ephemeral
    one can be handed to any process's outgoing connection)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(low, high - count)
        sockets: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports in {low}-{high - 1}")


# Ports a launcher reserves for one run. `free_port()` answers from the ephemeral range, which the kernel
# hands to any process's outgoing connection, and the port is only bound seconds later by a child: two
# launches at once, or one busy machine, took the same port (issue 35). Reserved ports come from above the
# ephemeral range (never given out by the kernel), start at an offset derived from the run, and each is
# held by an flock on `<lock_dir>/<port>` for as long as the reserving process lives, so a second launcher
# skips it. The lock dies with the process that held it: a crashed launcher leaves no stale reservation.
PORT_LOCK_DIR = Path(os.environ.get("TMPDIR") or "/tmp") / "prime-rl-ports"
_EPHEMERAL_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def reserved_port_range() -> tuple[int, int]:
    """[low, high) of the ports a launcher reserves: above the kernel's ephemeral range when at least 1024
    ports remain there (61000-65535 with Linux's default 32768-60999), else the 1024+ ports below it."""
    try:
        eph_low, eph_high = (int(x) for x in _EPHEMERAL_FILE.read_text().split())
    except (OSError, ValueError):
        eph_low, eph_high = 32768, 60999
    if 65536 - (eph_high + 1) >= 1024:
        return eph_high + 1, 65536
    return max(1024, eph_low - 8192), eph_low


@dataclass
class PortLease:
    """``count`` consecutive ports from ``base``, held (flock) until ``release()`` or the process exits."""

    base: int
    count: int
    _locks: list[int] = field(default_factory=list, repr=False)

    @property
    def ports(self) -> list[int]:
        return list(range(self.base, self.base + self.count))

    def release(self) -> None:
        for fd in self._locks:
            os.close(fd)
        self._locks.clear()


def _lock_port(lock_dir: Path, port: int) -> int | None:
    try:  # read-only is enough for flock, and opens a file another user created
        fd = os.open(lock_dir / str(port), os.O_RDONLY | os.O_CREAT, 0o666)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def reserve_ports(
    count: int, key: str, host: str = "127.0.0.1", lock_dir: Path | None = None, span: tuple[int, int] | None = None
) -> PortLease:
    """``count`` consecutive ports, locked for this process and free to bind on `host` now. The search starts
    at an offset derived from ``key`` (the run directory) and walks the range; ports another live process
    has locked, or that do not bind, are skipped. Keep the lease referenced: closing it frees the ports."""
    lock_dir = lock_dir or PORT_LOCK_DIR
    lock_dir.mkdir(parents=True, exist_ok=True)
    try:
        lock_dir.chmod(0o1777)  # shared by every user's launchers, like /tmp
    except OSError:
        pass
    low, high = span or reserved_port_range()
    slots = high - low - count + 1
    start = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % slots
    for step in range(slots):
        base = low + (start + step) % slots
        lease = PortLease(base, count)
        for port in lease.ports:
            fd = _lock_port(lock_dir, port)
            if fd is None:
                break
            lease._locks.append(fd)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    break
        else:
            return lease
        lease.release()
    raise RuntimeError(f"no {count} consecutive ports free and unreserved in {low}-{high - 1} (locks in {lock_dir})")


# The leases behind `free_port`'s recent answers (see there).
_RECENT: deque[PortLease] = deque()
_RECENT_KEEP = 64
_RECENT_LOCK = threading.Lock()
