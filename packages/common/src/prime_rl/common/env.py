"""Every ``PRIME_RL_*`` environment variable: the protocol between the launchers and the processes they start.

Each constant says who sets the variable, who reads it and what it means. Code reads and writes these
names through the constants; the SLURM templates (``prime_rl/launcher/templates/*.sbatch.j2``) spell
them out in shell, and ``tests/test_env.py`` checks that every name used anywhere is one of these.
Variables of other programs (``CUDA_VISIBLE_DEVICES``, ``VLLM_*``, torchrun's ``RANK`` ...) are not here.
"""

SECRET_FILE_ENV = "PRIME_RL_SECRET_FILE"
"""Path of the run secret (``<run_dir>/control.secret``). Set by `rl` (local) and the sbatch script (SLURM,
rendered by ``launcher/slurm/render.py``) for every process of a run; read by ``auth.RunSecret.from_env``
(every ZeroMQ socket authenticates with CURVE keys derived from it) and ``inference.sbatch.j2`` (the HTTP
API key). Unset: loopback-only sockets without authentication."""

HEARTBEAT_DIR_ENV = "PRIME_RL_HEARTBEAT_DIR"
"""Directory each process writes its heartbeats to. Set by `rl` and, per node, by ``base.sbatch.j2``;
read by ``heartbeat.Heartbeat.from_env`` (unset: heartbeats are no-ops, e.g. a process started by hand)."""

STALL_TIMEOUT_ENV = "PRIME_RL_STALL_TIMEOUT"
"""Seconds a phase may run without progress when its heartbeat names no deadline of its own. Set by `rl`
from ``stall_timeout`` and by the sbatch script (``[slurm.env_vars]`` may set it); read by
``heartbeat.Heartbeat.from_env`` (unset: ``heartbeat.DEFAULT_DEADLINE_S``)."""

STDOUT_IS_LOG_ENV = "PRIME_RL_STDOUT_IS_LOG"
"""``1``: this process's stdout already goes to its log file, so it opens none of its own. Set by `rl`
for the orchestrator; read by the orchestrator entrypoint."""

TRAINER_LOG_DIR_ENV = "PRIME_RL_TRAINER_LOG_DIR"
"""Directory for the trainer's per-rank log files (``logs/attempt_<n>/trainer/torchrun``). Set by `rl`,
multi-GPU `sft` and the rl / sft sbatch scripts; read by the trainer (``trainer/sft/train.py``; unset, as
under a hand-started torchrun: rank 0 starts a new log attempt) and the sbatch watchdog."""

PROFILE_DIR_ENV = "PRIME_RL_PROFILE_DIR"
"""Set by a user: record a few steps of the trainer's real loop with the torch profiler on rank 0 and write
``trace.json``, ``ops.txt`` and ``kernels.json`` here. Read by ``trainer/loop.py`` (``StepProfiler``)."""

PROFILE_STEPS_ENV = "PRIME_RL_PROFILE_STEPS"
"""Set by a user, with ``PRIME_RL_PROFILE_DIR``: the 1-based steps to profile, comma-separated (default
``4,5``). Read by ``trainer/loop.py``."""

HTTP_API_KEY_ENV = "PRIME_RL_HTTP_API_KEY"
"""The Bearer key every HTTP route of an inference server but ``/health``, ``/ping``, ``/metrics`` requires.
Set by ``inference/http_auth.guard_every_route`` from ``--api-key`` / ``VLLM_API_KEY`` inside the server
process (vLLM's API-server processes inherit it); read by its ``GuardEveryRoute`` middleware, which
Starlette builds without arguments."""

SKIP_INSTALL_ENV = "PRIME_RL_SKIP_INSTALL"
"""Set by a user (``1``) on a SLURM submission: skip ``[slurm] install`` on the batch node. Read by
``base.sbatch.j2``."""

ALL = (
    SECRET_FILE_ENV,
    HEARTBEAT_DIR_ENV,
    STALL_TIMEOUT_ENV,
    STDOUT_IS_LOG_ENV,
    TRAINER_LOG_DIR_ENV,
    PROFILE_DIR_ENV,
    PROFILE_STEPS_ENV,
    HTTP_API_KEY_ENV,
    SKIP_INSTALL_ENV,
)
"""Every variable above."""
