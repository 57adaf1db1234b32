"""StepOffload (colocated runs): between steps the trainer waits for its optimizer state's copy to the host,
returns the allocator's free blocks to the driver, and logs the memory of each phase. CPU: with a recording
memory reader and through the real RL trainer (where there is no device memory to log); GPU: the memory
really falls and the numbers of the run do not change (`pytest -m gpu packages/trainer/tests/test_colocate.py`)."""

import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch

from prime_rl.common.testing import make_tiny_model
from prime_rl.trainer.colocate import GiB, StepOffload


class Recorder:
    def __init__(self):
        self.events: list[str] = []
        self.allocated, self.reserved, self.peak = 3 * GiB, 8 * GiB, 5 * GiB

    def memory(self):
        self.events.append("read")
        return self.allocated, self.reserved, self.peak

    def wait(self):  # OptimizerOffload.wait: the moments' D2H copy is done
        self.events.append("wait")
        self.allocated = 1 * GiB

    def empty_cache(self):
        self.events.append("empty_cache")
        self.reserved = 2 * GiB


def test_release_waits_for_the_offload_then_returns_memory_and_reports_each_phase():
    rec = Recorder()
    offload = StepOffload(torch.device("cpu"), rec, memory=rec.memory, empty_cache=rec.empty_cache)
    offload.at_batch()
    metrics = offload.release()
    assert rec.events == ["read", "read", "wait", "empty_cache", "read"]  # freed only after the copy is done
    assert metrics["memory/at_batch_allocated"] == 3 and metrics["memory/at_batch_reserved"] == 8
    assert metrics["memory/peak_allocated"] == 5
    assert (metrics["memory/released_allocated"], metrics["memory/released_reserved"]) == (1, 2)
    assert metrics["time/release"] >= 0
    assert offload.release().keys() == {"memory/before_release_allocated", "memory/before_release_reserved",
                                        "memory/peak_allocated", "memory/released_allocated",
                                        "memory/released_reserved", "time/release"}  # fmt: skip


def test_make_room_still_frees_cycles_of_each_step_after_freezing_what_outlives_the_first():
    class Cycle:
        def __init__(self):
            self.me, self.tensor = self, torch.zeros(4)

    offload = StepOffload(torch.device("cpu"))
    kept = Cycle()  # alive at the first make_room: frozen, like the model and the compiled code
    try:
        offload.make_room()
        assert gc.get_freeze_count() > 0
        step = weakref.ref(Cycle().tensor)  # a later step's tensor held only by a cycle
        offload.make_room()
        assert step() is None, "make_room no longer frees a step's cyclic garbage"
        # frozen once: a later step's objects stay in the collected generations. (Not the freeze count: frozen
        # objects that die by reference counting leave it, so under xdist it moves without any freeze.)
        later = Cycle()
        offload.make_room()
        assert any(o is later for o in gc.get_objects(generation=2)), "a later make_room froze the step's objects"
    finally:
        gc.unfreeze()  # this pytest worker's other tests expect an ordinary collector
    assert kept.me is kept


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny"
    make_tiny_model(path, kind="qwen3", dtype="float32")
    return path


def _train(model, out, *extra) -> list[dict]:
    cmd = [sys.executable, "-m", "prime_rl.trainer.rl.train", "--model.name", str(model), "--output-dir", str(out),
           "--run-name", "run", "--data.fake", "--data.fake.generate-samples", "--data.fake.doc-len", "40",
           "--data.seq-len", "128", "--data.fake.batch-size", "2", "--max-steps", "2",
           "--weight-broadcast.dtype", "float32", *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "run/monitors/file/metrics.jsonl").read_text().splitlines()]


def test_the_rl_trainer_releases_between_steps_on_cpu(tiny_model, tmp_path):
    rows = _train(tiny_model, tmp_path, "--offload-between-steps")
    assert [r["step"] for r in rows] == [1, 2] and all("time/release" in r for r in rows)
    assert not any(k.startswith("memory/") for k in rows[0])  # no device memory on a CPU run


@pytest.mark.gpu
def test_release_frees_the_gpu_and_changes_no_number(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = make_tiny_model(tmp_path / "wide", kind="qwen3", dtype="float32", hidden_size=1024, num_layers=4,
                            intermediate_size=4096)  # fmt: skip
    common = ["--model.offload", "optimizer", "--model.ac", "None", "--optim.lr", "1e-3"]
    ref = _train(model, tmp_path / "ref", *common)
    got = _train(model, tmp_path / "colo", *common, "--offload-between-steps")
    for a, b in zip(ref, got, strict=True):
        assert b["loss/mean"] == a["loss/mean"] and b["optim/grad_norm"] == a["optim/grad_norm"]
    for row in got:
        assert row["memory/released_reserved"] < row["memory/before_release_reserved"]
        assert row["memory/released_allocated"] <= row["memory/before_release_allocated"]
        assert row["memory/peak_allocated"] >= row["memory/before_release_allocated"]
