"""`ContextParallelSource`: cp rank 0 alone pulls rows, the other cp ranks of its group get the same rows, and
an error on cp rank 0 reaches them as an error (not a hang in the broadcast). 2 gloo ranks, cp=2 (separate
data-parallel groups on their own rows: test_batching.py::test_dp2_by_cp2_matches_one_process)."""

import pytest
import torch.distributed as dist

from prime_rl.trainer.rl.batching import padding_run
from prime_rl.trainer.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess  # several processes: the dev-venv suite runs them


class _Rows:
    def __init__(self, dp_rank: int):
        self.dp_rank = dp_rank

    def get(self, step: int):
        if step == 1:
            raise ValueError(f"step mismatch on group {self.dp_rank}")
        return [padding_run(8 * (self.dp_rank + 1), temperature=0.5 + self.dp_rank)]

    def close(self) -> None:
        pass


def _cp_rank() -> tuple[int, int, float, str | None]:
    from prime_rl.trainer.rl.data import ContextParallelSource

    dp_rank, cp_rank = dist.get_rank() // 2, dist.get_rank() % 2
    made = []
    source = ContextParallelSource(lambda: made.append(1) or _Rows(dp_rank), cp_rank, 2, timeout_s=30)
    rows = source.get(0)
    try:
        source.get(1)
        error = None
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    return len(made), rows[0].input_ids.shape[-1], rows[0].temperature, error


def test_cp_rank_zero_receives_and_broadcasts_per_group():
    made, length, temperature, errors = zip(*run_on_ranks(_cp_rank, 2))
    assert made == (1, 0)  # one receiver (the group's socket), on cp rank 0
    assert length == (8, 8) and temperature == (0.5, 0.5)  # cp rank 1 got cp rank 0's rows
    assert errors[0] == "ValueError: step mismatch on group 0"  # cp rank 0 raises its own error
    assert errors[1].startswith("RuntimeError: context-parallel rank 0 of this group failed to receive step 1")
    assert "step mismatch on group 0" in errors[1]
