"""Environments that misbehave on cue, loaded by worker processes in test_env_workers.py (`type = "python"`)."""

from __future__ import annotations

import os
import time

from prime_rl.orchestrator.envs.reverse_text import ReverseTextEnv


class FaultyEnv(ReverseTextEnv):
    """reverse_text whose scorer hangs on the completion "HANG", kills its process on "CRASH" and raises on "BOOM"."""

    name = "faulty"

    def __init__(self, hang_s: float = 3600.0, **kwargs):
        super().__init__(**kwargs)
        self.hang_s = hang_s

    def score(self, task, completion_text):
        if completion_text == "HANG":
            time.sleep(self.hang_s)
        if completion_text == "CRASH":
            os._exit(3)
        if completion_text == "BOOM":
            raise ValueError("grader crashed on BOOM")
        return super().score(task, completion_text)


def not_an_env():
    return 42
