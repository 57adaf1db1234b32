"""`pinned_empty`: exact-size page-locked host buffers (torch's pinned allocator rounds up to a power of two)."""

import gc
import os

import pytest

torch = pytest.importorskip("torch", reason="prime_rl.common.weight_sync needs prime-rl-common[torch]")

from prime_rl.common.weight_sync.pinned import pinned_empty  # noqa: E402

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
