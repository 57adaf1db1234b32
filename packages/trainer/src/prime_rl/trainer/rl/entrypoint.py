"""`trainer @ train.toml`: the RL trainer in this process (the `rl` launcher runs it under torchrun)."""

from prime_rl.trainer.rl.train import main

__all__ = ["main"]
