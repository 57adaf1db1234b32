"""A verifiers taskset whose reward needs a runtime (a sandbox), which prime-rl does not provide."""

from __future__ import annotations

import verifiers.v1 as vf


class SandboxedTask(vf.Task):
    @vf.reward
    async def tests_pass(self, trace: vf.Trace, runtime: vf.Runtime) -> float:
        return 1.0


class SandboxedTaskset(vf.Taskset[SandboxedTask, vf.TasksetConfig]):
    def load(self) -> list[SandboxedTask]:
        return [SandboxedTask(vf.TaskData(prompt="hi"))]


__all__ = ["SandboxedTaskset"]
