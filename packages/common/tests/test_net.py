"""Port reservation for launchers: disjoint between live processes, outside the ephemeral range, freed on death."""

import socket
import subprocess
import sys

import pytest

from prime_rl.common import net
from prime_rl.common.net import reserve_ports, reserved_port_range

pytestmark = pytest.mark.chaos

_HOLD = """
import sys
from pathlib import Path
from prime_rl.common.net import reserve_ports
lease = reserve_ports(int(sys.argv[2]), "same-run", lock_dir=Path(sys.argv[1]))
print(lease.base, flush=True)
sys.stdin.read()
"""


def _holder(lock_dir, count):
    return subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(lock_dir), str(count)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_range_is_outside_the_ephemeral_one():
    low, high = reserved_port_range()
    eph_low, eph_high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    assert high <= eph_low or low > eph_high
    assert high - low >= 1024


def test_two_processes_with_the_same_key_at_once_get_disjoint_blocks(tmp_path):
    procs = [_holder(tmp_path, 3) for _ in range(2)]
    try:
        bases = [int(p.stdout.readline() or -1) for p in procs]
        assert -1 not in bases, [p.stderr.read() for p in procs]
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=30)
    a, b = (set(range(base, base + 3)) for base in bases)
    assert not a & b, bases


def test_a_dead_holder_frees_its_ports_and_a_bound_port_is_skipped(tmp_path):
    first = reserve_ports(1, "k", lock_dir=tmp_path)
    held = reserve_ports(1, "k", lock_dir=tmp_path)
    assert held.base != first.base  # same start, first is locked
    first.release()
    again = reserve_ports(1, "k", lock_dir=tmp_path)
    assert again.base == first.base  # the lock died with its holder
    again.release()
    with socket.socket() as s:  # a port some other program listens on, unlocked: skipped
        s.bind(("127.0.0.1", first.base))
        s.listen()
        other = reserve_ports(1, "k", lock_dir=tmp_path)
        assert other.base not in (first.base, held.base)
    proc = _holder(tmp_path, 1)  # a process that dies (killed) without releasing
    base = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    assert reserve_ports(1, "k", lock_dir=tmp_path, span=(base, base + 1)).base == base


def test_free_port_is_never_one_the_kernel_hands_to_outgoing_connections_and_stays_locked(monkeypatch, tmp_path):
    """A test or launcher asks for a free port, then binds it a moment later: the port must not be one the kernel
    can give to another process's outgoing connection meanwhile (it did, in CI), nor one a second caller picks."""
    monkeypatch.setattr(net, "PORT_LOCK_DIR", tmp_path)
    port = net.free_port()
    low, high = reserved_port_range()
    assert low <= port < high
    with pytest.raises(RuntimeError, match="no 1 consecutive ports"):
        reserve_ports(1, "other", lock_dir=tmp_path, span=(port, port + 1))  # locked for this caller


def test_free_port_with_headroom_leaves_that_many_ports_above_it(monkeypatch, tmp_path):
    """An inference server derives its control ports from its HTTP port (+100): a test's free_port for it must
    leave that room below 65535, or the run fails at start-up (it did, in CI: 65471 + 100)."""
    monkeypatch.setattr(net, "PORT_LOCK_DIR", tmp_path)
    low, high = reserved_port_range()
    headroom = high - low - 3  # only three candidates: every call must land there
    for _ in range(3):
        port = net.free_port(headroom=headroom)
        assert low <= port < low + 3 and port + headroom < high


def test_the_fallback_without_a_usable_lock_dir_keeps_the_headroom_too(monkeypatch):
    """Where the lock directory cannot be used, free_port asks the kernel (bind 0): the port it returns must still
    leave ``headroom`` ports below 65535, and a headroom no ephemeral port can leave is refused in one line."""

    def unusable(*args, **kwargs):
        raise OSError("read-only file system")

    monkeypatch.setattr(net, "reserve_ports", unusable)
    ports = iter([65500, 65480, 40000])  # what the kernel hands out, in turn
    real_socket = socket.socket

    class Kernel(real_socket):
        def getsockname(self):
            return ("127.0.0.1", next(ports))

    monkeypatch.setattr(net.socket, "socket", Kernel)
    assert net.free_port(headroom=100) == 40000  # 65500 + 100 and 65480 + 100 pass 65535: asked again
    ports = iter([60000] * 64)
    with pytest.raises(RuntimeError, match=r"no free port at or below 5535 on 127.0.0.1 .* \(headroom 60000\)"):
        net.free_port(headroom=60000)
