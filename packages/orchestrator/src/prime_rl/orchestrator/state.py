"""The orchestrator's resumable state: next step, task-sampling rng, tasks drawn so far.

Saved as JSON at `checkpoints/step_<n>/orchestrator/state.json` (written to a temp file, then
renamed, so a crash never leaves half a file). `step` is the next step to produce. Rollouts that
were in flight or buffered at save time are not saved: after a resume they would be stale anyway,
and the restored rng draws fresh tasks in their place.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from prime_rl.common.diskfull import naming_disk_full

STATE_FILE = "state.json"


@dataclass
class OrchestratorState:
    step: int
    """Next step to produce."""
    tasks_drawn: int
    """Tasks sampled from the environment so far (the data position)."""
    rng_state: dict[str, Any]
    """numpy bit-generator state of the task-sampling rng."""
    seed: int

    @classmethod
    def capture(cls, step: int, tasks_drawn: int, rng: np.random.Generator, seed: int) -> OrchestratorState:
        return cls(step=step, tasks_drawn=tasks_drawn, rng_state=rng.bit_generator.state, seed=seed)

    def restore_rng(self) -> np.random.Generator:
        rng = np.random.default_rng(self.seed)
        rng.bit_generator.state = self.rng_state
        return rng


def save_state(state: OrchestratorState, directory: Path) -> Path:
    """Write ``state.json`` atomically; it is the orchestrator part's commit marker (``rundir.CHECKPOINT_MARKERS``)."""
    path = directory / STATE_FILE
    tmp = path.with_suffix(".json.tmp")
    with naming_disk_full(path, f"the orchestrator state of step {state.step}"):
        directory.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w") as f:
            f.write(json.dumps(asdict(state), indent=1))
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the commit marker
        os.replace(tmp, path)
    return path


def load_state(directory: Path) -> OrchestratorState:
    path = directory / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no orchestrator state at {path}; pick a step that has one or set ckpt.resume_step=None"
        )
    return OrchestratorState(**json.loads(path.read_text()))
