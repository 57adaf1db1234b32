"""Multi-GPU `sft`'s torchrun command, word for word as the entrypoint spelled it before prime_rl.common.commands."""

import sys
from pathlib import Path

from prime_rl.trainer.sft.entrypoint import torchrun_command


def test_sft_runs_its_ranks_under_the_loopback_torchrun():
    assert torchrun_command(Path("/run/configs/trainer.toml"), 2) == [
        sys.executable, "-m", "prime_rl.trainer.torchrun_loopback", "--nproc-per-node", "2",
        "--local-ranks-filter", "0", "-m", "prime_rl.trainer.sft.train", "@", "/run/configs/trainer.toml",
    ]  # fmt: skip
