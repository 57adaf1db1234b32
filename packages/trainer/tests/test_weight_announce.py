"""The trainer's version announcements (real ZeroMQ sockets): delivered even when the orchestrator binds
later, and never blocking a trainer whose orchestrator is gone."""

import subprocess
import sys
import time

from prime_rl.common.net import free_port
from prime_rl.common.transport import Receiver
from prime_rl.common.wire import WeightsPublished
from prime_rl.trainer.weights.announce import VersionAnnouncer


def test_announcement_reaches_an_orchestrator_that_binds_later():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    announcer = VersionAnnouncer(endpoint, timeout_s=5)
    start = time.perf_counter()
    announcer.announce(1, path="/run/broadcasts/step_1", publish_s=0.01, write_s=0.5)
    assert time.perf_counter() - start < 3.0  # queued, not blocked on the missing peer (the 5 s timeout)
    with Receiver(endpoint, bind=True, timeout_s=10, types=(WeightsPublished,)) as receiver:
        announcer.announce(2)
        got = [receiver.recv().message, receiver.recv().message]
    announcer.close()
    assert got == [
        WeightsPublished(version=1, path="/run/broadcasts/step_1", publish_s=0.01, write_s=0.5),
        WeightsPublished(version=2),
    ]


def test_the_last_announcement_survives_a_rank_that_ends_with_os_exit():
    """A trainer rank ends with ``os._exit`` (``exit_rank``) right after closing its publisher: the final
    version must still reach the orchestrator."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    script = (
        "import os, sys\n"
        "from prime_rl.trainer.weights.announce import VersionAnnouncer\n"
        "a = VersionAnnouncer(sys.argv[1], timeout_s=5)\n"
        "a.announce(7, path='/run/broadcasts/step_7')\n"
        "a.close()\n"
        "os._exit(0)\n"
    )
    with Receiver(endpoint, bind=True, timeout_s=20, types=(WeightsPublished,)) as receiver:
        for attempt in range(5):  # the loss was a race; several processes make it show without the fix
            proc = subprocess.run([sys.executable, "-c", script, endpoint], capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0, proc.stderr[-2000:]
            assert receiver.recv().message == WeightsPublished(version=7, path="/run/broadcasts/step_7"), attempt


def test_a_trainer_outliving_the_orchestrator_closes_within_the_linger():
    announcer = VersionAnnouncer(f"tcp://127.0.0.1:{free_port()}", timeout_s=600, linger_s=0.2)
    start = time.perf_counter()
    announcer.announce(30)  # the last version: the orchestrator has already finished
    announcer.close()
    assert time.perf_counter() - start < 2.0


def test_no_endpoint_announces_nothing():
    announcer = VersionAnnouncer(None)
    announcer.announce(1)
    announcer.close()
