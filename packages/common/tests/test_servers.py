"""ServerSet: the one fan-out of control requests to every inference server (both the orchestrator's filesystem
loads and the trainer's pushes go through it)."""

import threading
import time

import pytest

from prime_rl.common import wire
from prime_rl.common.servers import ServerSet
from prime_rl.common.transport import ControlServer, PeerLostError, ServerThread

LOOPBACK = "tcp://127.0.0.1:0"


class LoadError(RuntimeError):
    pass


@pytest.fixture
def servers(request):
    """Three control servers; each records the versions it was asked for and answers per ``request.param``."""
    barrier = threading.Barrier(3, timeout=20)  # generous under CI load; a sequential fan-out never passes it
    seen: list[list[int]] = [[], [], []]

    def handler(i: int):
        def handle(message, arrays):
            seen[i].append(message.version)
            barrier.wait()  # every server must hold its request at once: a sequential fan-out breaks the barrier
            if message.version == 13:
                return wire.ControlReply(ok=False, error=f"server {i} refuses 13")
            return wire.ControlReply(ok=True)

        return handle

    threads = [ServerThread(ControlServer(LOOPBACK), handler(i), f"server-{i}").start() for i in range(3)]
    yield [t.endpoint for t in threads], seen
    for thread in threads:
        thread.stop()


def test_every_server_gets_its_own_request_at_the_same_time(servers):
    addresses, seen = servers
    fanout = ServerSet(addresses, timeout_s=60, error=LoadError)
    try:
        replies = fanout.request(lambda i: wire.AwaitWeightsRequest(version=10 + i), "AwaitWeightsRequest")
    finally:
        fanout.close()
    assert replies == [wire.ControlReply(ok=True)] * 3
    assert seen == [[10], [11], [12]]


def test_a_refusal_raises_the_callers_error_naming_the_first_refusing_server_after_every_answer(servers):
    addresses, seen = servers
    fanout = ServerSet(addresses, timeout_s=60, error=LoadError)
    try:
        # servers 1 and 2 refuse (version 13); server 0 accepts: all three are asked, the error names server 1
        with pytest.raises(LoadError, match=rf"refused by inference server {addresses[1]}: server 1 refuses 13"):
            fanout.request(lambda i: wire.AwaitWeightsRequest(version=12 if i == 0 else 13), "AwaitWeightsRequest")
    finally:
        fanout.close()
    assert seen == [[12], [13], [13]]


def test_gather_returns_each_answer_for_the_caller_to_judge(servers):
    addresses, _ = servers
    fanout = ServerSet(addresses, timeout_s=60)
    try:
        replies = fanout.gather(lambda i: wire.AwaitWeightsRequest(version=12 + (i > 0)))
    finally:
        fanout.close()
    assert [r.ok for r in replies] == [True, False, False]
    assert replies[2].error == "server 2 refuses 13"


def test_fail_fast_skips_a_server_whose_connection_is_down_and_waits_for_the_rest():
    alive = ServerThread(ControlServer(LOOPBACK), lambda m, a: wire.ControlReply(ok=True), "alive").start()
    dead = ControlServer(LOOPBACK)
    fanout = ServerSet([dead.endpoint, alive.endpoint], timeout_s=30, watch_peer=True)
    try:
        answer = threading.Thread(target=dead.serve_once, args=(lambda m, a: wire.ControlReply(ok=True), 5.0))
        answer.start()
        assert [r.ok for r in fanout.gather(lambda i: wire.ResumeRequest())] == [True, True]
        answer.join()
        dead.close()
        deadline = time.monotonic() + 10
        while not fanout.clients[0].peer_gone and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fanout.clients[0].peer_gone
        start = time.monotonic()
        lost, reply = fanout.gather(lambda i: wire.ResumeRequest(), fail_fast=True)
        assert time.monotonic() - start < 5  # not the 30 s timeout
        assert isinstance(lost, PeerLostError) and "went away before ResumeRequest" in str(lost)
        assert reply == wire.ControlReply(ok=True)
        # a subset, in the order given
        assert fanout.gather(lambda i: wire.ResumeRequest(), indices=[1]) == [wire.ControlReply(ok=True)]
    finally:
        fanout.close()
        alive.stop()
