"""`pinned_empty`: exact-size page-locked host buffers (torch's pinned allocator rounds up to a power of two)."""

import gc
import os

import pytest

torch = pytest.importorskip("torch", reason="prime_rl.common.weight_sync needs prime-rl-common[torch]")

from prime_rl.common.weight_sync import pinned  # noqa: E402
from prime_rl.common.weight_sync.pinned import PAGE, pinned_empty  # noqa: E402

MiB = 1 << 20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_without_cuda_or_pin_it_is_a_plain_tensor_of_the_shape_asked_for():
    t = pinned_empty((3, 5), torch.bfloat16, pin=False)
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and t.device.type == "cpu"
    assert pinned_empty(0, torch.float32).numel() == 0
    if not torch.cuda.is_available():
        assert not pinned_empty(7, torch.float32).is_pinned()


def test_each_buffer_registers_whole_pages_of_its_own_and_unregisters_them_when_collected(monkeypatch):
    """cudaHostRegister refuses a range overlapping a registered one, and small host buffers share pages: every
    pinned buffer locks only whole pages of a mapping of its own, and gives them back when it is collected.
    (Registration itself is stubbed here; the GPU test below makes it for real.)"""
    registered: dict[int, int] = {}

    def register(ptr: int, nbytes: int) -> None:
        assert ptr % PAGE == 0 and nbytes % PAGE == 0, (ptr, nbytes)
        assert all(ptr + nbytes <= p or p + n <= ptr for p, n in registered.items()), "overlaps a registered range"
        registered[ptr] = nbytes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned, "_register", register)
    monkeypatch.setattr(pinned, "_unregister", registered.pop)
    buffers = [
        pinned_empty((3, 7), torch.float32),
        pinned_empty(5, torch.bfloat16),
        pinned_empty(3 * PAGE + 1, torch.uint8),
    ]
    assert [(b.shape, b.dtype) for b in buffers] == [
        ((3, 7), torch.float32),
        ((5,), torch.bfloat16),
        ((3 * PAGE + 1,), torch.uint8),
    ]
    for b in buffers:  # each registered range starts at its data (is_pinned looks there) and holds all of it
        assert registered[b.data_ptr()] >= b.numel() * b.element_size()
    assert sorted(registered.values()) == [PAGE, PAGE, 4 * PAGE]
    buffers[2].fill_(7)
    view = buffers[2][:10]
    del buffers, b
    gc.collect()
    assert registered == {}  # unregistered with the tensors pinned_empty returned
    assert view.tolist() == [7] * 10  # the memory itself lives on for a view that outlives its base


@pytest.mark.gpu
def test_a_pinned_buffer_locks_its_size_not_the_power_of_two_above_and_copies_asynchronously():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pinned_empty(MiB, torch.uint8)  # the first registration maps the driver's own pages (~90 MiB on an H200)
    size = 600 * MiB  # torch.empty(pin_memory=True) would lock 1 GiB for it
    before = _rss_bytes()
    host = pinned_empty(size // 4, torch.float32)
    grown = _rss_bytes() - before
    assert host.is_pinned()
    assert size <= grown < size + 64 * MiB, f"locking 600 MiB grew the process by {grown / MiB:.0f} MiB"

    device = torch.arange(host.numel(), dtype=torch.float32, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        host.copy_(device, non_blocking=True)
    stream.synchronize()
    assert torch.equal(host[-5:], device[-5:].cpu())

    del host
    gc.collect()  # unregistered, then freed: a new buffer in the same place registers again
    again = pinned_empty(size // 4, torch.float32)
    assert again.is_pinned()


def test_a_driver_that_refuses_registration_falls_back_to_torch_s_pinned_allocator(monkeypatch, caplog):
    def refuse(ptr: int, nbytes: int) -> None:
        raise RuntimeError("operation not supported (801)")

    allocated = []
    empty = torch.empty
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned, "_register", refuse)
    monkeypatch.setattr(
        torch, "empty", lambda *a, **kw: allocated.append(kw) or empty(*a, **{**kw, "pin_memory": False})
    )
    t = pinned_empty((2, 3), torch.float16)
    assert t.shape == (2, 3) and t.dtype == torch.float16
    assert allocated == [{"dtype": torch.float16, "pin_memory": True}]
    assert "cudaHostRegister of 4096 bytes failed (operation not supported (801))" in caplog.text
