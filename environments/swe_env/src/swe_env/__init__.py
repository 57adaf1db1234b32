"""swe_env: a multi-turn tool environment for prime-rl in which the model fixes bugs in small Python repositories.

    [[orchestrator.env]]
    type = "python"
    entrypoint = "swe_env:SWEEnvironment"
    kwargs = { tasks = "/shared/swe/tasks.jsonl" }   # or leave kwargs out: the bundled tasks

See the package README for the task format and the security notes.
"""

from swe_env.env import SWEEnvironment
from swe_env.tasks import load_tasks, validate_task

__all__ = ["SWEEnvironment", "load_tasks", "validate_task"]
