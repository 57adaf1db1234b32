"""The per-process configs of an ``rl`` SLURM job.

``RLConfig`` already wires its three sections for one machine (model, run dir, max_steps, batch
port). The rest is resolved as for a local run, by ``prime_rl.launcher.resolution.resolve``, with the submit
host's facts (``gather_slurm``: the served dtype; no ports, no resume step). What depends on the allocation
(the router's host, every replica's control address, the head trainer node) is known only inside the job, so
rl.sbatch.j2 passes it to each process as flags.
"""

from __future__ import annotations

from pydantic import BaseModel

from prime_rl.common.config.rl import RLConfig
from prime_rl.launcher.host_facts import HostFacts, gather_slurm
from prime_rl.launcher.resolution import resolve


def resolve_rl_job(config: RLConfig, host: HostFacts | None = None) -> tuple[RLConfig, dict[str, BaseModel]]:
    """The resolved job config (kept as launcher/rl.toml) and its ``{"trainer", "orchestrator", "inference"}``
    configs; ``config`` is left as it is. ``host`` defaults to this submit host's facts."""
    run = resolve(config, gather_slurm(config) if host is None else host)
    return run.config, run.process_configs()
