"""Environment worker processes: an environment server the orchestrator talks to over ZeroMQ.

Process layout: each `[[orchestrator.env]]` entry with `workers = k` gets k processes
(`python -m prime_rl.orchestrator.envs.worker`), each building the environment from its config and
serving calls one at a time on a ROUTER socket (ipc://). The orchestrator holds one DEALER socket per
worker and a reader task that resolves each reply's future by request id; calls go to the worker with
the fewest in flight.

Faults, all confined to rollouts: a call past its deadline while the worker runs it kills the worker
(SIGKILL: it may be stuck in C code); a worker that dies is noticed by its reader within `POLL_S`; either
way the call it was running fails and a fresh worker replaces it. A worker serves its calls in order, so
the calls queued behind that one never ran: each is sent once more, to the replacement, with a fresh clock
(failing them scored innocent rollouts 0, a negative advantage); a call caught behind a second hang fails
as a crash, so a step where everything hangs costs about two budgets, not one per queued call. A call
whose deadline passes while it waits behind another (still within its own deadline) just fails.

A worker that cannot build its environment (unknown id, missing package, bad arguments) answers the first
call with the error, which `start()` raises as one line before any rollout.

Start-up is not a call's time: every worker (at `start()` and each replacement) first answers an "info"
handshake within `START_TIMEOUT_S`; calls go to workers that are up, and while none is, they wait outside
their rollout's budget (`EnvHandle.until_started`). Charging the start-up to the call killed the replacement
of an environment that builds slower than one rollout's budget, then its replacement, and so on: every
later rollout failed.

Messages are `prime_rl.common.wire.Message` structs with the common envelope (schema version first);
they live here, beside the only two ends that speak them. Arguments and results are msgpack (tasks and
chat messages are JSON-able by contract).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from prime_rl.common.wire import EnvReply, EnvRequest, Message, decode_header, encode_header
from prime_rl.orchestrator.envs.handle import (
    EnvCrashed,
    EnvFailure,
    EnvHandle,
    EnvInfo,
    EnvTimeout,
    dispatch,
    wait_at_most,
)

logger = logging.getLogger(__name__)

POLL_S = 0.5
"""How often a worker checks that its parent lives, and a reader that its worker does."""
START_TIMEOUT_S = 120.0
"""Seconds a worker may take to import and build its environment."""


ENV_MESSAGES: tuple[type[Message], ...] = (EnvRequest, EnvReply)


def serve(endpoint: str, config: dict[str, Any]) -> None:
    """Worker main loop: build the environment, then answer calls until the parent goes away."""
    from pydantic import TypeAdapter

    from prime_rl.common.config.orchestrator import EnvConfig
    from prime_rl.orchestrator.envs.registry import build_environment

    try:
        env, build_error = build_environment(TypeAdapter(EnvConfig).validate_python(config)), ""
    except Exception as e:  # reported on the first call, so the orchestrator fails with this line
        env, build_error = None, f"{type(e).__name__}: {e}"
    parent = os.getppid()
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    while os.getppid() == parent:
        if not sock.poll(int(POLL_S * 1000)):
            continue
        identity, header = sock.recv_multipart()
        request = decode_header(header, ENV_MESSAGES).message
        if env is None:
            reply = EnvReply(request.id, False, error=build_error)
        else:
            try:
                result = dispatch(env, request.method, msgspec.msgpack.decode(request.args))
                reply = EnvReply(request.id, True, msgspec.msgpack.encode(result))
            except Exception as e:
                reply = EnvReply(request.id, False, error=f"{type(e).__name__}: {e}")
        sock.send_multipart([identity, encode_header(reply)])


class _Requeued(EnvCrashed):
    """A call that never ran: its worker was killed for the call ahead of it (`_call` sends it once more)."""


class _Worker:
    def __init__(self, proc: subprocess.Popen, sock: zmq.asyncio.Socket, endpoint: str) -> None:
        self.proc, self.sock, self.endpoint = proc, sock, endpoint
        self.pending: dict[int, asyncio.Future] = {}
        self.reader: asyncio.Task | None = None
        self.ready: asyncio.Task | None = None
        """The start-up handshake ("info"): its result once the worker has built its environment."""


class WorkerEnv(EnvHandle):
    """An environment served by `num_workers` worker processes."""

    def __init__(
        self, config: dict[str, Any], name: str, weight: float = 1.0, timeout: float = 60.0, num_workers: int = 1
    ) -> None:
        super().__init__(name, weight, timeout)
        self.config, self.num_workers = config, num_workers
        self._ids = itertools.count()
        self._dir = Path(tempfile.mkdtemp(prefix="prl-env-"))
        self._ctx = zmq.asyncio.Context.instance()
        self.workers: list[_Worker] = []
        self.restarts = 0

    async def start(self) -> None:
        self.workers = [self._spawn(i) for i in range(self.num_workers)]
        try:
            infos = await asyncio.gather(*(self._until_ready(w) for w in self.workers))
        except EnvFailure as e:
            await self.close()
            raise ValueError(f"environment {self.name!r} ({self.config.get('type')}) failed to start: {e}") from None
        info = infos[0]
        self.info = EnvInfo(self.name, info["multi_turn"], info["max_turns"], info["tools"], info["tool_call_parser"])

    def _spawn(self, index: int) -> _Worker:
        endpoint = f"ipc://{self._dir}/w{index}-{self.restarts}.sock"
        proc = subprocess.Popen(
            [sys.executable, "-m", "prime_rl.orchestrator.envs.worker", endpoint, json.dumps(self.config)],
            stdin=subprocess.DEVNULL,
        )
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        worker = _Worker(proc, sock, endpoint)
        worker.reader = asyncio.create_task(self._read(worker), name=f"env-{self.name}-reader")
        worker.ready = asyncio.create_task(
            self._request(worker, "info", {}, START_TIMEOUT_S), name=f"env-{self.name}-handshake"
        )
        # its error reaches the callers that wait on it; with none waiting it is not an unretrieved exception
        worker.ready.add_done_callback(lambda t: t.cancelled() or t.exception())
        return worker

    async def _until_ready(self, worker: _Worker) -> dict[str, Any]:
        """Wait for the worker's handshake (raises its EnvFailure). Not ``await worker.ready``: a cancelled
        caller (a rollout stopped at shutdown) would cancel the handshake that other callers wait on."""
        assert worker.ready is not None
        if not worker.ready.done():
            await asyncio.wait({worker.ready})
        return worker.ready.result()

    async def _read(self, worker: _Worker) -> None:
        while True:
            if await worker.sock.poll(int(POLL_S * 1000)):
                reply = decode_header(await worker.sock.recv(), ENV_MESSAGES).message
                future = worker.pending.pop(reply.id, None)
                if future is not None and not future.done():
                    future.set_result(reply)
            elif worker.proc.poll() is not None:
                error = EnvCrashed(f"environment {self.name} worker exited with {worker.proc.returncode}")
                self._fail(worker, error, only_running=True)
                await self._replace(worker)
                return

    def _fail(self, worker: _Worker, error: EnvFailure, only_running: bool = False) -> None:
        """Fail the calls in flight on ``worker`` with ``error``; with ``only_running``, only the one it was
        running (the oldest: calls are served in order), the others never ran and are sent again."""
        running = min(worker.pending, default=None)
        requeued = _Requeued(f"environment {self.name}: the worker was killed for a call ahead of this one")
        for request_id, future in worker.pending.items():
            if not future.done():
                future.set_exception(requeued if only_running and request_id != running else error)
        worker.pending.clear()

    async def _replace(self, worker: _Worker) -> None:
        if worker not in self.workers:
            return
        # The replacement takes the slot before the first await: a call picking a worker meanwhile must not
        # send to the dying one (its reply never comes; the call would wait out its whole budget).
        index = self.workers.index(worker)
        self.restarts += 1
        self.counters["restarts"] += 1
        logger.warning("environment %s: restarting a worker (%d restarts so far)", self.name, self.restarts)
        self.workers[index] = self._spawn(index)
        if worker.reader is not None and worker.reader is not asyncio.current_task():
            worker.reader.cancel()
        if worker.proc.poll() is None:
            worker.proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(worker.proc.wait)
        worker.sock.close()

    async def _request(self, worker: _Worker, method: str, args: dict[str, Any], timeout: float) -> Any:
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        worker.pending[request_id] = future
        await worker.sock.send(encode_header(EnvRequest(request_id, method, msgspec.msgpack.encode(args))))
        if not await wait_at_most(future, timeout):
            running = min(worker.pending, default=request_id) == request_id  # else it waited behind another
            worker.pending.pop(request_id, None)
            if running:  # the worker is stuck in this call: kill it; the calls behind it go to the replacement
                self._fail(worker, _Requeued(f"environment {self.name}: the worker was killed for a call ahead"))
                await self._replace(worker)
            raise EnvTimeout(f"environment {self.name}.{method} took more than {timeout:.1f}s") from None
        reply = future.result()  # raises EnvCrashed when the worker died meanwhile
        if not reply.ok:
            raise EnvFailure(f"environment {self.name}.{method} raised {reply.error}")
        return msgspec.msgpack.decode(reply.result)

    async def until_started(self) -> None:
        """Until some worker has finished its handshake (all may be replacements still starting)."""
        handshakes = {w.ready for w in self.workers if w.ready is not None}
        if handshakes and not any(h.done() for h in handshakes):
            await asyncio.wait(handshakes, return_when=asyncio.FIRST_COMPLETED)

    async def _call(self, method: str, args: dict[str, Any], timeout: float) -> Any:
        # workers that are up first (`call` waited for one): a call's clock never runs during a start-up
        requeued = False
        while True:
            started = [w for w in self.workers if w.ready is not None and w.ready.done()] or self.workers
            worker = min(started, key=lambda w: len(w.pending))
            try:
                await self._until_ready(worker)  # raises the handshake's error
                if worker in self.workers:  # not replaced while its handshake was awaited
                    return await self._request(worker, method, args, timeout)
            except _Requeued:
                if requeued:  # behind a second hang: counted as a crash (EnvCrashed)
                    raise
                requeued = True

    async def close(self) -> None:
        for worker in self.workers:
            for task in (worker.reader, worker.ready):
                if task is not None and not task.done():
                    task.cancel()
            if worker.proc.poll() is None:
                worker.proc.send_signal(signal.SIGKILL)
                worker.proc.wait()
            worker.sock.close()
        self.workers = []
        shutil.rmtree(self._dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="prime_rl.orchestrator.envs.worker")
    parser.add_argument("endpoint")
    parser.add_argument("config", help="the [[orchestrator.env]] entry as JSON")
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the orchestrator stops its workers; Ctrl-C goes to it
    serve(args.endpoint, json.loads(args.config))


if __name__ == "__main__":
    main()
