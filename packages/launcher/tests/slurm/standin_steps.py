"""Stand-ins for an rl job's inference replicas, router and orchestrator, exec'd by the fake ``srun`` of
test_render.py (``FAKE_EXEC``) with srun's argv: what the job's restart path talks to, without vLLM.

- ``inference-node<i>``: HTTP ``/health`` on ``--server.port`` and a control plane (run secret from the environment)
  on ``--server.control-port`` reporting the weight version in ``$FAKE_DIR/<step>.version``: 3 at its first start (the
  policy), 0 after a restart (the model's own weights) until the "orchestrator" writes 3. Its first start SIGKILLs
  itself once ``$FAKE_DIR/kill`` exists if its step is in ``FAKE_KILL``, or, in ``FAKE_WEDGE``, writes one heartbeat
  with a 1 s deadline then never again (alive, wedged; SIGTERM ends it); a restart of a step in ``FAKE_RESTART_DIES``
  exits 1 after a moment (dies during start-up).
- ``router``: ``/health`` answers; ``POST /add_worker`` and ``/remove_worker`` are appended to ``$FAKE_DIR/router.calls``.
- ``orchestrator``: creates ``kill`` (then, with ``FAKE_RELOAD=never`` or several steps to kill, waits to be
  stopped), waits for the dead replica's ``remove_worker``, checks it is not re-added while
  it serves version 0 (written to ``$FAKE_DIR/orchestrator.out``), "reloads" the policy into it (version 3), waits for
  its ``add_worker``, keeps a copy of the run's STATUS and exits 0 (1 when something does not happen in time).
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

from prime_rl.common.testing_http import serve_http

ARGV = sys.argv[1:]
NAME = next(a.split("=", 1)[1] for a in ARGV if a.startswith("--job-name="))
DIR = Path(os.environ["FAKE_DIR"])


def arg_after(flag: str) -> str:
    return ARGV[ARGV.index(flag) + 1]


def replica() -> None:
    from prime_rl.common.heartbeat import Heartbeat
    from prime_rl.common.transport import ControlServer  # here: the other stand-ins start faster without ZeroMQ
    from prime_rl.common.wire import HealthReply

    starts = DIR / f"{NAME}.starts"
    first = not starts.exists()
    with starts.open("a") as f:
        f.write("start\n")
    version = DIR / f"{NAME}.version"
    version.write_text("3" if first else "0")
    if not first and NAME in os.environ.get("FAKE_RESTART_DIES", "").split(","):
        time.sleep(0.5)
        sys.exit(1)
    serve_http(int(arg_after("--server.port")))
    control = ControlServer(f"tcp://127.0.0.1:{arg_after('--server.control-port')}")
    stop = threading.Event()
    reply = lambda message, arrays: HealthReply(ok=True, weight_version=int(version.read_text()))  # noqa: E731
    threading.Thread(target=control.serve_forever, args=(reply, stop), daemon=True).start()
    dies = first and NAME in os.environ.get("FAKE_KILL", "").split(",")
    wedges = first and NAME in os.environ.get("FAKE_WEDGE", "").split(",")
    while True:
        if dies and (DIR / "kill").exists():
            os.kill(os.getpid(), signal.SIGKILL)
        if wedges and (DIR / "kill").exists():
            wedges = False
            Heartbeat(os.environ["PRIME_RL_HEARTBEAT_DIR"], "inference", 0).beat("serving", deadline_s=1.0)
        time.sleep(0.1)


def router() -> None:
    def record(request) -> int:
        with (DIR / "router.calls").open("a") as f:
            f.write(request.path + "\n")
        return 200

    serve_http(int(arg_after("--port")), record)
    while True:
        time.sleep(1)


def wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.1)


def orchestrator() -> None:
    dead = os.environ.get("FAKE_KILL") or os.environ["FAKE_WEDGE"]
    calls = DIR / "router.calls"
    (DIR / "kill").write_text("")
    if "," in dead or os.environ.get("FAKE_RELOAD") == "never":  # the job is to end without this one
        time.sleep(30)
        sys.exit(1)
    wait_for(lambda: calls.exists() and "remove_worker" in calls.read_text())
    wait_for(lambda: (DIR / f"{dead}.starts").read_text().count("start") == 2)
    time.sleep(1.5)  # longer than the watcher's probe interval (1 s): it saw version 0 and did not re-admit
    (DIR / "orchestrator.out").write_text("re-added at version 0\n" if "add_worker" in calls.read_text() else "ok\n")
    (DIR / f"{dead}.version").write_text("3")  # the orchestrator's reload of the served policy
    wait_for(lambda: "add_worker" in calls.read_text())
    # readmit puts the replica back into the router first and then writes STATUS: wait for that write
    status = Path(arg_after("@")).parent.parent / "logs" / "latest" / "STATUS"
    wait_for(lambda: "is back after restart" in status.read_text())
    (DIR / "status.json").write_text(status.read_text())


if __name__ == "__main__":
    if NAME.startswith("inference-node"):
        replica()
    else:
        {"router": router, "orchestrator": orchestrator}[NAME]()
