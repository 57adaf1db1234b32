"""The run-directory layout every process agrees on (DESIGN.md "Run directory").

    <output_dir>/<run_name>/
      configs/                          resolved configs, one per process
      logs/attempt_<n>/ + logs/latest -> attempt_<n>
          inference.log  orchestrator.log  trainer/torchrun/<rank>.log
      monitors/file/metrics.jsonl
      checkpoints/step_<n>/{trainer,orchestrator}/
      broadcasts/step_<n>/
      launcher/

Design decisions:
- Paths are pure functions of (output_dir, run_name, step); nothing is created until a process asks
  (``ensure=True`` or ``start_attempt``), so the launcher's ``--dry-run`` can print paths for free.
- Each launch is a new log attempt: ``start_attempt()`` creates ``logs/attempt_<n+1>`` and re-points
  ``logs/latest`` atomically (symlink to a temp name, then ``os.replace``), so a reader never sees
  a missing ``latest``. Processes started by the launcher log under ``attempt_dir`` (which follows
  ``latest``), so they need no attempt number passed down.
- A checkpoint step is complete only when every component's part is: each part's commit marker
  (``CHECKPOINT_MARKERS``) is the last thing its writer puts there, so a part with its marker is whole.
  ``latest_complete_checkpoint(components)`` is what "latest" means for a run with those components,
  resolved once by the launcher and handed to every component as an explicit step.
- ``discard_after(step)`` renames what a dead attempt left beyond the resume point (newer
  checkpoint steps, complete or not, and newer weight broadcasts) to ``*.discarded-<n>`` so no component can
  load it (a broadcast newer than the resumed trainer would be served as a future policy), without
  deleting anything a person may still want. The rows of ``metrics.jsonl`` past that step go the same
  way (to ``metrics.jsonl.discarded-<n>``): the resumed run logs those steps again, each once.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

_ATTEMPT = re.compile(r"^attempt_(\d+)$")
CHECKPOINT_MARKERS = {"trainer": ".done", "orchestrator": "state.json"}
"""Per component: the file its checkpoint writer creates last inside ``checkpoints/step_<n>/<component>/``."""
BROADCAST_MARKER = "STABLE"
"""The file the trainer writes last into ``broadcasts/step_<n>.tmp/`` before renaming it into place; a version
without it is not complete: inference refuses to load it and the orchestrator never serves it."""
_STEP = re.compile(r"^step_(\d+)$")


def _steps(parent: Path, pattern: re.Pattern[str]) -> list[int]:
    if not parent.is_dir():
        return []
    return sorted(int(m.group(1)) for p in parent.iterdir() if (m := pattern.match(p.name)) and p.is_dir())


class RunDir:
    """Paths of one run: ``RunDir(output_dir, run_name)``."""

    def __init__(self, output_dir: str | os.PathLike[str], run_name: str) -> None:
        if not run_name or "/" in run_name or run_name in (".", ".."):
            raise ValueError(f"run_name={run_name!r} must be one non-empty path component (no '/'); e.g. 'rl-qwen3'")
        self.output_dir = Path(output_dir)
        self.run_name = run_name

    def __repr__(self) -> str:
        return f"RunDir({str(self.output_dir)!r}, {self.run_name!r})"

    @property
    def root(self) -> Path:
        return self.output_dir / self.run_name

    @property
    def configs_dir(self) -> Path:
        return self.root / "configs"

    def config_path(self, component: str) -> Path:
        """Resolved config of one process, e.g. ``configs/trainer.toml``."""
        return self.configs_dir / f"{component}.toml"

    # -- logs --------------------------------------------------------------------------------

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def latest_logs(self) -> Path:
        """The ``logs/latest`` symlink."""
        return self.logs_dir / "latest"

    def attempts(self) -> list[int]:
        """Attempt numbers present, ascending."""
        return _steps(self.logs_dir, _ATTEMPT)

    @property
    def attempt(self) -> int:
        """The attempt ``logs/latest`` points at; raises if no attempt was started."""
        target = os.readlink(self.latest_logs) if self.latest_logs.is_symlink() else None
        match = _ATTEMPT.match(Path(target).name) if target else None
        if match is None:
            raise FileNotFoundError(
                f"{self.latest_logs} is not a link to attempt_<n>; the launcher calls RunDir.start_attempt() first"
            )
        return int(match.group(1))

    def attempt_logs_dir(self, attempt: int | None = None) -> Path:
        """``logs/attempt_<n>`` (the latest attempt when ``attempt`` is None)."""
        return self.logs_dir / f"attempt_{self.attempt if attempt is None else attempt}"

    def start_attempt(self) -> int:
        """Create the next ``logs/attempt_<n>`` (1-based) and point ``logs/latest`` at it."""
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        attempt = max(self.attempts(), default=0) + 1
        while True:  # another launcher may race us for the same number
            try:
                (self.logs_dir / f"attempt_{attempt}").mkdir()
                break
            except FileExistsError:
                attempt += 1
        tmp = self.logs_dir / f".latest.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        os.symlink(f"attempt_{attempt}", tmp)  # relative: the run dir stays movable
        os.replace(tmp, self.latest_logs)
        return attempt

    def log_path(self, component: str, attempt: int | None = None) -> Path:
        """``logs/attempt_<n>/<component>.log`` (inference, orchestrator, ...)."""
        return self.attempt_logs_dir(attempt) / f"{component}.log"

    def trainer_log_dir(self, attempt: int | None = None) -> Path:
        """``logs/attempt_<n>/trainer/torchrun`` (torchrun writes ``<rank>.log`` files here)."""
        return self.attempt_logs_dir(attempt) / "trainer" / "torchrun"

    def trainer_log_path(self, rank: int, attempt: int | None = None) -> Path:
        return self.trainer_log_dir(attempt) / f"{rank}.log"

    # -- monitors ----------------------------------------------------------------------------

    @property
    def metrics_path(self) -> Path:
        """``monitors/file/metrics.jsonl``."""
        return self.root / "monitors" / "file" / "metrics.jsonl"

    # -- checkpoints and weight broadcasts ---------------------------------------------------

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint_dir(self, step: int) -> Path:
        """``checkpoints/step_<n>``."""
        return self.checkpoints_dir / f"step_{_check_step(step)}"

    def trainer_checkpoint_dir(self, step: int) -> Path:
        return self.checkpoint_dir(step) / "trainer"

    def orchestrator_checkpoint_dir(self, step: int) -> Path:
        return self.checkpoint_dir(step) / "orchestrator"

    def checkpoint_steps(self) -> list[int]:
        """Steps with a ``checkpoints/step_<n>`` directory, ascending."""
        return _steps(self.checkpoints_dir, _STEP)

    def checkpoint_part_complete(self, step: int, component: str) -> bool:
        return (self.checkpoint_dir(step) / component / CHECKPOINT_MARKERS[component]).is_file()

    def complete_checkpoint_steps(self, components: tuple[str, ...] = ("trainer", "orchestrator")) -> list[int]:
        """Steps whose every listed component's part is complete, ascending."""
        return [s for s in self.checkpoint_steps() if all(self.checkpoint_part_complete(s, c) for c in components)]

    def checkpoint_components(self) -> tuple[str, ...]:
        """The components whose parts make a step complete here: the trainer's, and in an RL run (any step
        has an orchestrator part) the orchestrator's too, so a trainer started alone agrees with `rl`."""
        if any(self.orchestrator_checkpoint_dir(s).is_dir() for s in self.checkpoint_steps()):
            return ("trainer", "orchestrator")
        return ("trainer",)

    def latest_complete_checkpoint(self, components: tuple[str, ...] = ("trainer", "orchestrator")) -> int | None:
        steps = self.complete_checkpoint_steps(components)
        return steps[-1] if steps else None

    def resolve_resume_step(
        self, resume_step: int | str | None, components: tuple[str, ...] = ("trainer", "orchestrator")
    ) -> int | None:
        """One resume step for every component: "latest" = newest complete for all; an explicit step must be."""
        if resume_step is None:
            return None
        complete = self.complete_checkpoint_steps(components)
        if resume_step == "latest":
            return complete[-1] if complete else None
        if resume_step not in complete:
            partial = {c: self.checkpoint_part_complete(resume_step, c) for c in components}
            raise FileNotFoundError(
                f"ckpt.resume_step={resume_step}: checkpoints/step_{resume_step} is not complete for every component "
                f"(complete parts: {partial}); complete steps: {complete or 'none'}; pick one of them or 'latest'"
            )
        return int(resume_step)

    def discard_after(self, step: int | None) -> list[Path]:
        """Rename checkpoint steps and broadcasts newer than ``step`` (all of them for a fresh start, None).

        What is left is exactly the history up to the resume point; returns the new paths.
        """
        attempt = max(self.attempts(), default=0)
        moved = []
        for s in self.checkpoint_steps():
            if step is None or s > step:
                moved.append(_rename_aside(self.checkpoint_dir(s), attempt))
        for s in self.broadcast_steps():
            if step is None or s > step:
                moved.append(_rename_aside(self.broadcast_dir(s), attempt))
        if (aside := _drop_metrics_after(self.metrics_path, step, attempt)) is not None:
            moved.append(aside)
        return moved

    @property
    def broadcasts_dir(self) -> Path:
        return self.root / "broadcasts"

    def broadcast_dir(self, step: int) -> Path:
        """``broadcasts/step_<n>`` (filesystem weight transport)."""
        return self.broadcasts_dir / f"step_{_check_step(step)}"

    def broadcast_steps(self, *, published: bool = False) -> list[int]:
        """Steps with a ``broadcasts/step_<n>`` directory, ascending; ``published``: only those holding
        ``BROADCAST_MARKER`` (complete versions inference may load)."""
        steps = _steps(self.broadcasts_dir, _STEP)
        if published:
            steps = [s for s in steps if (self.broadcast_dir(s) / BROADCAST_MARKER).is_file()]
        return steps

    def latest_published_step(self, max_step: int | None = None) -> int | None:
        """Newest published step (``n <= max_step`` if given); None if there is none."""
        steps = [s for s in self.broadcast_steps(published=True) if max_step is None or s <= max_step]
        return steps[-1] if steps else None

    @property
    def launcher_dir(self) -> Path:
        """``launcher/`` (SLURM: rl.sbatch and logs/)."""
        return self.root / "launcher"

    def ensure(self) -> RunDir:
        """Create the fixed directories (not attempts, checkpoints or broadcasts)."""
        for d in (self.configs_dir, self.logs_dir, self.metrics_path.parent, self.checkpoints_dir, self.broadcasts_dir):
            d.mkdir(parents=True, exist_ok=True)
        return self


def _rename_aside(path: Path, attempt: int) -> Path:
    target = path.with_name(f"{path.name}.discarded-{attempt}")
    n = 0
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.discarded-{attempt}.{n}")
    os.rename(path, target)
    return target


def _drop_metrics_after(path: Path, step: int | None, attempt: int) -> Path | None:
    """Move the rows of metrics.jsonl newer than ``step`` (all for None) to ``metrics.jsonl.discarded-<n>``.

    The resumed run logs those steps again: left in place, each would be in the file twice. An unterminated
    last line (a writer killed mid-line) goes too, or the next row would be glued to it. Returns where the
    dropped rows went, None when nothing was dropped. Nothing writes the file while the launcher calls this.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    kept, dropped = [], []
    *lines, tail = data.split(b"\n")
    for line in lines:
        try:
            row_step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            row_step = None  # not a row: kept as it was (readers skip it)
        newer = isinstance(row_step, int) and (step is None or row_step > step)
        (dropped if newer else kept).append(line + b"\n")
    if tail:
        dropped.append(tail + b"\n")
    if not dropped:
        return None
    aside = path.with_name(f"{path.name}.discarded-{attempt}")
    n = 0
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.discarded-{attempt}.{n}")
    aside.write_bytes(b"".join(dropped))
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(b"".join(kept))
    os.replace(tmp, path)  # a reader sees the old file or the new one, never half of it
    return aside


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an int >= 0")
    return step
