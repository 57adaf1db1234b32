"""Local networking helpers shared by launchers, trainers, tests and benchmarks."""

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on `host` right now (another process may still take it later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
