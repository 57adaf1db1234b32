"""The NIXL receiver's own checks, no peer needed (its transfers with the trainer's senders:
tests/test_nixl_transfer.py)."""

import pytest

# The receiver runs in vLLM's workers: torch comes with the cpu/gpu extra, absent from a bare install.
torch = pytest.importorskip("torch", reason="prime_rl.inference.weights.nixl_receiver needs prime-rl-inference[cpu]")

from prime_rl.inference.weights.nixl_receiver import NixlTransferError, allocate_arenas  # noqa: E402


def test_arena_allocation_failure_is_an_error():
    with pytest.raises(NixlTransferError, match="overlap_transfer_and_replay = false"):
        allocate_arenas(2, 1 << 62, torch.device("cpu"), "receiver")
