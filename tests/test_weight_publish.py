"""Weight publication (filesystem transport) on CPU: background writes give the files a synchronous write
gives, a trainer killed mid-write leaves the last complete version the only visible one, and every
complete version is announced to the orchestrator's socket (a real ZeroMQ PULL socket here).

Cross-package (trainer publishes, orchestrator listens): it lives in the root tests/, so that each
package's own tests run with only that package installed (scripts/check_packages.sh)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prime_rl.common.net import free_port
from prime_rl.common.rundir import RunDir
from prime_rl.common.testing import make_tiny_model
from prime_rl.common.weight_checksum import CHECKSUMS_FILE, compute_checksums, read_checksums
from prime_rl.orchestrator.weights import VersionListener
from prime_rl.trainer.rl.publish_base import BackgroundJob, prune_versions
from prime_rl.trainer.testing import torchrun
from prime_rl.trainer.weights.files import publish_dir, remove_partial_dirs, tmp_dir_of

WORKER = Path(__file__).with_name("publish_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3", seed=0)


def _drain(listener: VersionListener, wait: float) -> list:
    got, deadline = [], time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            got.append(listener.open().recv(timeout_s=0.05).message)
        except TimeoutError:
            pass
    return got


def _drain_until(listener: VersionListener, version: int, wait: float) -> list:
    """Messages received until one announces ``version`` (or ``wait`` seconds pass)."""
    got, deadline = [], time.monotonic() + wait
    while time.monotonic() < deadline and version not in [m.version for m in got]:
        got += _drain(listener, 0.1)
    return got


def test_background_publication_is_bit_identical_to_synchronous(tiny_model_dir, tmp_path):
    listener = VersionListener(f"tcp://127.0.0.1:{free_port()}")
    listener.open()
    torchrun(
        str(WORKER), "compare", str(tiny_model_dir), str(tmp_path), listener.endpoint, nproc=2, timeout=300, env=ENV
    )
    run_dir = RunDir(tmp_path, "run")
    assert run_dir.broadcast_steps() == [1, 2]
    for version in (1, 2):
        published, reference = run_dir.broadcast_dir(version), tmp_path / f"ref_{version}"
        assert (published / "STABLE").is_file()
        names = sorted(p.name for p in reference.iterdir())
        extra = ("STABLE", CHECKSUMS_FILE)  # the checksums inference verifies an update against, matching the files
        assert sorted(p.name for p in published.iterdir() if p.name not in extra) == names
        assert read_checksums(published) == compute_checksums(published)
        for name in names:  # weight files byte for byte, and config.json / tokenizer files
            assert (published / name).read_bytes() == (reference / name).read_bytes(), f"step_{version}/{name}"
        weights = load_file(str(published / "model.safetensors"))
        assert all(t.dtype == torch.bfloat16 for t in weights.values())
    # the weights changed between versions, and the in-place update after publish() did not leak in
    one = load_file(str(run_dir.broadcast_dir(1) / "model.safetensors"))
    two = load_file(str(run_dir.broadcast_dir(2) / "model.safetensors"))
    assert any(not torch.equal(one[k], two[k]) for k in one)

    messages = _drain(listener, 1.0)
    listener.close()
    assert [m.version for m in messages] == [1, 2]
    assert [m.path for m in messages] == [str(run_dir.broadcast_dir(v)) for v in (1, 2)]
    assert all(m.publish_s > 0 and m.write_s > 0 for m in messages)


def test_a_slow_disk_never_blocks_the_loop_and_the_newest_version_wins(tiny_model_dir, tmp_path):
    listener = VersionListener(f"tcp://127.0.0.1:{free_port()}")
    listener.open()
    cmd = [sys.executable, str(WORKER), "skip", str(tiny_model_dir), str(tmp_path), listener.endpoint]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    blocked = [float(line.split("blocked=")[1].rstrip("s")) for line in proc.stdout.splitlines() if "blocked=" in line]
    assert len(blocked) == 3 and max(blocked) < 0.5  # each write takes > 1 s; publish() never waited for one
    assert "SKIPPED 1" in proc.stdout
    run_dir = RunDir(tmp_path, "run")
    assert run_dir.broadcast_steps() == [1, 3]  # version 2 was never written ...
    assert [m.version for m in _drain(listener, 1.0)] == [1, 3]  # ... nor announced
    published = load_file(str(run_dir.broadcast_dir(3) / "model.safetensors"))
    reference = load_file(str(tmp_path / "ref_3" / "model.safetensors"))
    assert all(torch.equal(published[k], reference[k]) for k in reference)
    listener.close()


def test_trainer_killed_mid_write_leaves_last_complete_version(tiny_model_dir, tmp_path):
    listener = VersionListener(f"tcp://127.0.0.1:{free_port()}")
    listener.open()
    cmd = [sys.executable, str(WORKER), "crash", str(tiny_model_dir), str(tmp_path), listener.endpoint]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        line = ""
        deadline = time.monotonic() + 240
        while "WRITING" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert "WRITING" in line, proc.stderr.read()[-3000:] if proc.poll() is not None else "no WRITING"
        # version 1's announcement is on its way (ZeroMQ's I/O thread); on a loaded machine a kill right now could
        # drop it with the process (CI): wait for it, while the writer stalls, before killing
        announced = _drain_until(listener, 1, 60.0)
        proc.send_signal(signal.SIGKILL)  # the trainer dies with version 2 half written
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    run_dir = RunDir(tmp_path, "run")
    broadcasts = run_dir.broadcasts_dir
    partial = broadcasts / "step_2.tmp" / "model.safetensors"
    complete = load_file(str(run_dir.broadcast_dir(1) / "model.safetensors"))
    assert 0 < len(load_file(str(partial))) < len(complete)  # the write really was cut off mid-way ...
    # ... yet only version 1 is visible: to the trainer's run dir, the orchestrator's start-up scan,
    # and the orchestrator's socket (version 2 was never announced)
    assert run_dir.broadcast_steps() == [1]
    assert run_dir.latest_published_step() == 1
    assert [m.version for m in announced + _drain(listener, 1.0)] == [1]
    listener.close()
    # the next trainer start removes the leftover
    assert remove_partial_dirs(broadcasts) == [broadcasts / "step_2.tmp"]
    assert sorted(p.name for p in broadcasts.iterdir()) == ["step_1"]


def test_publish_dir_replaces_an_older_copy_atomically(tmp_path):
    final = tmp_path / "step_3"
    for content in (b"old", b"new"):
        tmp = tmp_dir_of(final)
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(content)
        publish_dir(tmp, final)
    assert (final / "model.safetensors").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3"]


def test_background_job_runs_one_at_a_time_and_reraises():
    job, order = BackgroundJob("writer"), []
    job.start(lambda: (time.sleep(0.2), order.append("first")))
    waited = job.wait()
    assert order == ["first"] and waited >= 0.1
    job.start(lambda: 1 / 0)
    with pytest.raises(RuntimeError, match="writer failed: ZeroDivisionError"):
        job.wait()
    assert job.wait() == pytest.approx(0, abs=0.05)  # the error is raised once


def test_keep_last_never_prunes_the_newest_and_drops_versions_of_an_abandoned_run(tmp_path):
    run_dir = RunDir(tmp_path, "run")
    for step in (1, 2, 3, 7, 8):  # 7, 8: written by a run that went further before this one resumed
        (run_dir.broadcast_dir(step)).mkdir(parents=True)
    (tmp_dir_of(run_dir.broadcast_dir(5))).mkdir()  # being written: never listed, never pruned here
    prune_versions(run_dir, 4 - 1, keep_last=2)
    assert run_dir.broadcast_steps() == [2, 3]
    assert (run_dir.broadcasts_dir / "step_5.tmp").is_dir()
