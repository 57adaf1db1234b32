"""`trainer @ train.toml`: the RL trainer in this process (the `rl` launcher runs it under torchrun).

`--help` is answered from the config schema before `prime_rl.trainer.rl.train` (torch, the model code:
~4 s) is imported; everything else, `--dry-run` included, runs `train.main` as before.
"""

from __future__ import annotations

import sys

from prime_rl.common.config import asks_for_help, parse_config
from prime_rl.common.config.rl_trainer import RLTrainerConfig


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if asks_for_help(argv):
        parse_config(RLTrainerConfig, argv, prog="trainer")  # prints the help, exits 0
    from prime_rl.trainer.rl.train import main as train_main

    train_main(argv)


__all__ = ["main"]
