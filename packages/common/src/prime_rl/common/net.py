"""Local networking helpers shared by launchers, trainers, tests and benchmarks."""

import random
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on `host` right now (another process may still take it later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
