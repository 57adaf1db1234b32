"""Waiting out an inference restart (heal.py): a fake server that disappears mid-run (requests in flight dropped,
new ones refused) and comes back with its start-up weights; the real orchestrator loop must hold rollouts,
reload the served policy before any request reaches the new server, send the lost groups again and train on."""

import asyncio
import importlib.util
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from prime_rl.common.monitor import FileMonitor, read_metrics
from prime_rl.common.net import free_port
from prime_rl.common.rundir import RunDir
from prime_rl.common.transport import PeerLostError
from prime_rl.common.wire import HealthReply
from prime_rl.orchestrator.batch import BatchSender
from prime_rl.orchestrator.client import InferenceClient, InferenceLost, resent_by_caller
from prime_rl.orchestrator.envs.reverse_text import ReverseTextEnv
from prime_rl.orchestrator.heal import InferenceGoneError, InferenceWatch
from prime_rl.orchestrator.orchestrator import Orchestrator
from prime_rl.orchestrator.policy import PolicyState
from prime_rl.orchestrator.weights import InferenceControlError

_spec = importlib.util.spec_from_file_location(
    "_orchestrator_e2e", Path(__file__).with_name("test_orchestrator_e2e.py")
)
_e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_e2e)
FakeTrainer, make_config = _e2e.FakeTrainer, _e2e.make_config


class Server(ThreadingHTTPServer):
    request_queue_size = 256
    daemon_threads = True


class RestartingServer:
    """An OpenAI-compatible server (answers from ``fake.respond``) that can go away and come back on its port.

    Each answered request records the weight version the server served when answering it (``served_version()``;
    None: the request met a dead server and its connection drops)."""

    def __init__(self, fake, served_version, delay: float = 0.05) -> None:
        self.fake, self.served_version, self.delay = fake, served_version, delay
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.down = False
        self.answered: list[int] = []
        self.dropped = 0
        self._lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._reply(503 if outer.down else 200, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                time.sleep(outer.delay)
                version = None if outer.down else outer.served_version()
                if version is None:  # died mid-request: the connection closes without an answer
                    with outer._lock:
                        outer.dropped += 1
                    self.close_connection = True
                    return
                with outer._lock:
                    outer.answered.append(version)
                self._reply(200, outer.fake.respond(body))

            def _reply(self, status: int, payload: dict):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = Server(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def die(self) -> None:
        self.down = True
        self.httpd.shutdown()
        self.httpd.server_close()

    def come_back(self) -> None:
        self.down = False
        self._start()

    def close(self) -> None:
        if not self.down:
            self.die()


class RestartingControl:
    """Control plane of one server: loads set its version, a restart resets it to the model's own (0)."""

    def __init__(self) -> None:
        self.version = 0
        self.up = True
        self.calls: list[tuple] = []
        self.endpoints, self.excluded = ["tcp://fake:1"], set()  # one server: an outage holds every request

    async def pause(self, mode):
        self.calls.append(("pause", mode))

    async def load_weights(self, path, version):
        assert self.up, "a weight load was sent to a server that is down"
        self.calls.append(("load", Path(path).name, version))
        self.version = version

    async def resume(self):
        self.calls.append(("resume",))

    async def health(self):
        return [HealthReply(ok=True, weight_version=self.version) if self.up else None]

    def close(self):
        pass


async def _run_orchestrator(
    config, run_dir: RunDir, control, poll_interval: float | None = None, max_retries: int = 1
) -> Orchestrator:
    """The orchestrator's run against the fake server and trainer, with its clients closed however it ends."""
    client = InferenceClient(
        config.model.client.base_url, config.model.name, max_retries=max_retries, retry_backoff=0.01
    )
    sender = BatchSender("127.0.0.1", config.trainer.port, config.num_train_ranks, timeout=30)
    monitor = FileMonitor(run_dir)
    orchestrator = Orchestrator(config, ReverseTextEnv(min_len=3, max_len=6), client, control, sender.send, monitor)
    if poll_interval is not None:
        orchestrator.watch.poll_interval = poll_interval
    try:
        await asyncio.wait_for(orchestrator.run(), timeout=60)
    finally:
        await client.aclose()
        sender.close()
        monitor.close()
    return orchestrator


def test_an_outage_holds_rollouts_reloads_the_policy_and_resends_them(tmp_path, make_server, ports):
    control = RestartingControl()
    server = RestartingServer(make_server(), lambda: control.version)
    port = ports.free_range(2)
    config = make_config(tmp_path, server.base_url, port, max_steps=5, inference={"outage_timeout": 30})
    run_dir = RunDir(tmp_path, "run")
    trainer = FakeTrainer(run_dir, port, num_ranks=2, num_steps=5, weights_port=config.trainer.weights_port)
    outage: dict[str, float] = {}

    def restart_once_policy_2_serves() -> None:
        deadline = time.monotonic() + 30
        while control.version < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        outage["version"] = control.version
        control.up = False
        server.die()
        outage["answered_before"] = len(server.answered)
        time.sleep(1.5)
        control.version = 0  # the restarted server serves the checkpoint's weights
        control.up = True
        server.come_back()

    killer = threading.Thread(target=restart_once_policy_2_serves)
    killer.start()

    try:
        asyncio.run(_run_orchestrator(config, run_dir, control, poll_interval=0.1))
    finally:
        killer.join()
        server.close()
    trainer.join()

    served = outage["version"]
    assert served >= 2
    # after the outage, the served version was loaded again before any request reached the new server
    after = server.answered[outage["answered_before"] :]
    assert after and min(after) >= served, (served, after[:10])
    reloads = [c for c in control.calls if c[0] == "load" and c[2] == served]
    assert len(reloads) == 2, control.calls  # once announced, once after the restart
    metrics = read_metrics(run_dir.metrics_path)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]  # no step missing
    assert sum(m["inference/outages"] for m in metrics) == 1
    assert sum(m["inference/reloads"] for m in metrics) == 1
    resent = sum(m["rollouts/resent"] for m in metrics)
    assert resent >= config.group_size and resent % config.group_size == 0
    assert sum(m["inference/outage_s"] for m in metrics) >= 1.0
    # the off-policy rule still holds: each batch's version within max_off_policy_steps of its step
    for m in metrics:
        assert m["step"] - 1 - m["policy/batch_version"] <= config.max_off_policy_steps


class _Updater:
    def __init__(self) -> None:
        from prime_rl.common.heartbeat import Heartbeat

        self.heartbeat = Heartbeat(None, "orchestrator")
        self.reloads = 0

    async def reload(self, _dir):
        self.reloads += 1
        return 1


def test_a_request_lost_to_an_outage_is_sent_again_by_the_client_or_raised_to_the_scheduler(make_server):
    """Outside the scheduler (evals, template probes) the client waits and sends again; inside it raises
    InferenceLost so the scheduler re-gates the group."""
    control = RestartingControl()
    server = RestartingServer(make_server(), lambda: control.version, delay=0.0)

    async def go() -> None:
        policy = PolicyState(version=1)
        client = InferenceClient(server.base_url, "tiny", max_retries=0, retry_backoff=0.01)
        watch = InferenceWatch(policy, _Updater(), control, client.healthy, Path("/nonexistent"),
                               outage_timeout=10, poll_interval=0.05)  # fmt: skip
        client.watch = watch
        server.die()
        control.up = False
        messages = [{"role": "user", "content": "abc"}]
        from prime_rl.orchestrator.client import SamplingArgs

        sampling = SamplingArgs(max_tokens=8, temperature=1.0)
        with resent_by_caller(), pytest.raises(InferenceLost):
            await client.sample(messages, 2, sampling)
        assert watch.down and not policy.is_open

        async def back_later() -> None:
            await asyncio.sleep(0.5)
            control.up = True
            server.come_back()

        asyncio.get_running_loop().create_task(back_later())
        result = await client.sample(messages, 2, sampling)  # waits for the recovery, then sends again
        assert len(result.completions) == 2 and client.num_resent >= 0
        assert policy.is_open and watch.counters["inference/outages"] == 1
        assert watch.counters["inference/reloads"] == 1  # the server said version 0, the policy is 1
        await client.aclose()

    try:
        asyncio.run(go())
    finally:
        server.close()


def test_an_outage_past_its_deadline_fails_naming_the_setting(make_server):
    control = RestartingControl()
    control.up = False

    async def go() -> None:
        policy = PolicyState(version=0)

        async def never() -> bool:
            return False

        watch = InferenceWatch(policy, _Updater(), control, never, Path("/x"), outage_timeout=0.3, poll_interval=0.05)
        await watch.lost("test")
        with pytest.raises(InferenceGoneError, match="outage_timeout=0s"):
            await watch.wait()
        assert policy.is_open  # waiters are released to see the failure, never left blocked

    asyncio.run(go())


class DiesDuringLoad(RestartingControl):
    """The first load of ``version`` or a newer one dies with the server (which restarts at 0), showing as ``how``: no
    answer until the timeout, the connection dropping (API server killed), or an error reply (vLLM's engine core
    killed). Or a newer one: under load the orchestrator may go from version 1 straight to the newest (CI saw it
    load no version 2 at all)."""

    def __init__(self, server_holder: list, version: int, how: str = "timeout") -> None:
        super().__init__()
        self.server_holder, self.die_at, self.died, self.how = server_holder, version, False, how

    async def load_weights(self, path, version):
        if version >= self.die_at and not self.died:
            self.died, self.up, self.version = True, False, 0
            self.calls.append(("died", Path(path).name, version))
            server = self.server_holder[0]
            server.die()
            threading.Timer(1.0, self._come_back, args=(server,)).start()
            if self.how == "dropped":
                raise PeerLostError("the connection to tcp://x closed before the reply to LoadWeightsRequest")
            if self.how == "error reply":
                raise InferenceControlError("LoadWeightsRequest failed on tcp://x: EngineDeadError")
            raise TimeoutError(f"no reply to LoadWeightsRequest within 0.1s (version {version})")
        await super().load_weights(path, version)

    def _come_back(self, server) -> None:
        self.up = True
        server.come_back()


@pytest.mark.parametrize("how", ["timeout", "dropped", "error reply"])
def test_a_server_that_dies_mid_update_is_waited_out_and_updated_again(tmp_path, make_server, ports, how):
    """Probe: a server dying during a weight load left that control request unanswered, and its timeout ended the run
    (600 s later: the dropped connection and the dying engine's error reply now count as the death at once)."""
    holder: list = []
    control = DiesDuringLoad(holder, version=2, how=how)
    server = RestartingServer(make_server(), lambda: control.version)
    holder.append(server)
    port = ports.free_range(2)
    config = make_config(tmp_path, server.base_url, port, max_steps=4, inference={"outage_timeout": 30})
    run_dir = RunDir(tmp_path, "run")
    trainer = FakeTrainer(run_dir, port, num_ranks=2, num_steps=4, weights_port=config.trainer.weights_port)

    try:
        asyncio.run(_run_orchestrator(config, run_dir, control, poll_interval=0.1))
    finally:
        server.close()
    trainer.join()
    assert control.died
    loads = [(c[0], c[2]) for c in control.calls if c[0] in ("load", "died")]
    # the load of 2 (or of a newer one) died; the restarted server got the served version back (if not the model's
    # own), then the newest policy: the one that died again, or a newer one the trainer wrote during the outage
    died = [kind for kind, _ in loads].index("died")
    lost = loads[died][1]
    served = loads[died - 1][1] if died else 0
    after = loads[died + 1 :]
    if served:
        assert after[0] == ("load", served), control.calls
        after = after[1:]
    assert after and after[0][0] == "load" and after[0][1] >= lost, control.calls
    metrics = read_metrics(run_dir.metrics_path)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert sum(m["inference/outages"] for m in metrics) == 1
    assert sum(m["inference/reloads"] for m in metrics) == (1 if served else 0)


def test_an_error_reply_from_a_live_server_still_stops_the_run(tmp_path, make_server, ports):
    """A refused update (the server stays healthy) is not a death: it stops the run naming the error, as before."""

    class Refuses(RestartingControl):
        async def load_weights(self, path, version):
            raise InferenceControlError(f"LoadWeightsRequest failed on tcp://x: bad checksum (version {version})")

    control = Refuses()
    server = RestartingServer(make_server(), lambda: control.version)
    port = ports.free_range(2)
    config = make_config(tmp_path, server.base_url, port, max_steps=3, inference={"outage_timeout": 30})
    run_dir = RunDir(tmp_path, "run")
    trainer = FakeTrainer(run_dir, port, num_ranks=2, num_steps=3, weights_port=config.trainer.weights_port)

    try:
        with pytest.raises(InferenceControlError, match="bad checksum"):
            asyncio.run(_run_orchestrator(config, run_dir, control))
    finally:
        server.close()  # the fake trainer's daemon threads wait for a step that never comes
    assert trainer.received[0], "the first step trained before the refused update"


class Router:
    """vllm-router's part in front of replicas (their control planes hold their versions): requests go round-robin
    over the replicas in the router; one that died but is not taken out yet drops them. ``answered``: (replica,
    version) of each answer."""

    def __init__(self, planes) -> None:
        self.planes = planes
        self.alive = [True] * len(planes)
        self.routed = [True] * len(planes)
        self.answered: list[tuple[int, int]] = []
        self._next = 0
        self._lock = threading.Lock()

    def serve(self) -> int | None:
        with self._lock:
            targets = [i for i, routed in enumerate(self.routed) if routed]
            i = targets[self._next % len(targets)]
            self._next += 1
            if not self.alive[i]:
                return None
            self.answered.append((i, self.planes[i].version))
            return self.planes[i].version


def test_one_dead_replica_of_two_is_waited_out_while_the_other_serves(tmp_path, make_server, ports, control_plane):
    """Probe (issue 35): with two replicas behind the router, one replica's death held every rollout until it was
    back. Now the other replica serves on; updates skip the dead one, which gets the served policy alone once it
    answers, and the router (the launcher, here a thread doing what `replica_restarts` does) takes it back only at
    the others' version."""
    from prime_rl.orchestrator.weights import ZmqInferenceControl

    planes = [control_plane(), control_plane()]
    router = Router(planes)
    server = RestartingServer(make_server(), router.serve)
    control = ZmqInferenceControl([p.endpoint for p in planes], timeout=30)
    port = ports.free_range(2)
    steps = 40  # ~3 s: the restart (0.8 s after the kill at step ~3) and re-admission fall well inside the run
    config = make_config(tmp_path, server.base_url, port, max_steps=steps, inference={"outage_timeout": 30})
    run_dir = RunDir(tmp_path, "run")
    trainer = FakeTrainer(run_dir, port, num_ranks=2, num_steps=steps, weights_port=config.trainer.weights_port)
    seen: dict = {}

    def launcher() -> None:  # kill replica 1 mid-step, once rollouts of policy 2 are answered; restart, re-admit it
        deadline = time.monotonic() + 30
        while not any(v >= 2 for _, v in router.answered[-4:]) and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["version"] = planes[1].version
        planes[1].die()
        router.alive[1] = False
        seen["killed_at"] = len(router.answered)
        time.sleep(0.3)
        router.routed[1] = False  # the launcher noticed the death
        time.sleep(0.5)
        planes[1].start()  # the model's own weights
        router.alive[1] = True
        while planes[1].version != planes[0].version and time.monotonic() < deadline + 30:
            time.sleep(0.01)
        seen["readmitted_at"] = len(router.answered)
        seen["readmitted_version"] = planes[1].version
        router.routed[1] = True

    thread = threading.Thread(target=launcher)
    thread.start()
    try:
        # resends are paced by the poll interval; the default 6 outlast the router's moment on the dead replica
        asyncio.run(_run_orchestrator(config, run_dir, control, poll_interval=0.1, max_retries=6))
    finally:
        thread.join()
        server.close()
        control.close()
    trainer.join()

    assert seen["version"] >= 2
    during = router.answered[seen["killed_at"] : seen["readmitted_at"]]
    assert len(during) >= config.group_size, "rollouts were held while one replica was down"
    assert all(replica == 0 for replica, _ in during)
    # the restarted replica got the served version alone (pause, load, resume) before the router took it back
    after = [name for name, boot in planes[1].requests if boot == planes[1].boot_id and name != "HealthRequest"]
    assert after[:3] == ["PauseRequest", "LoadWeightsRequest", "ResumeRequest"], after
    assert seen["readmitted_version"] >= seen["version"]
    restarted = [v for replica, v in router.answered[seen["readmitted_at"] :] if replica == 1]
    assert restarted and min(restarted) >= seen["readmitted_version"], restarted[:10]
    metrics = read_metrics(run_dir.metrics_path)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))  # no step missing
    assert sum(m["inference/outages"] for m in metrics) == 1
    assert sum(m["inference/reloads"] for m in metrics) == 1
    assert sum(m["rollouts/resent"] for m in metrics) % config.group_size == 0
    for m in metrics:  # the off-policy rule still holds
        assert m["step"] - 1 - m["policy/batch_version"] <= config.max_off_policy_steps
