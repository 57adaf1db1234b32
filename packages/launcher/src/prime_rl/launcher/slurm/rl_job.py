"""The per-process configs of an ``rl`` SLURM job.

``RLConfig`` already wires its three sections for one machine (model, run dir, max_steps, batch
port). What depends on the allocation (the router's host, every replica's control address, the head
trainer node) is known only inside the job, so rl.sbatch.j2 passes it to each process as flags.
"""

from __future__ import annotations

from pydantic import BaseModel

from prime_rl.common.config import ConfigError
from prime_rl.launcher.rl import served_dtype


def rl_process_configs(config: BaseModel) -> dict[str, BaseModel]:
    """``{"trainer", "orchestrator", "inference"}`` configs from a resolved multi-node ``RLConfig``."""
    trainer, orchestrator, inference = config.trainer, config.orchestrator, config.inference
    if trainer.model.dp_replicate > 1 and (config.deployment.num_train_nodes * config.deployment.gpus_per_node) % (
        trainer.model.dp_replicate
    ):
        raise ConfigError(
            f"trainer.model.dp_replicate={trainer.model.dp_replicate} must divide the trainer's "
            f"{config.deployment.num_train_nodes} nodes x {config.deployment.gpus_per_node} GPUs"
        )
    wb = trainer.weight_broadcast
    # Published weights must be in the dtype inference serves (every transport's receiver refuses others), so
    # it is set whether or not the config names one: `rl` hands its config over as a file of every value, so a
    # default bfloat16 reads as set, and an fp32 server refused every update (seen in tests/slurm).
    try:
        wb.dtype = served_dtype(config)
    except FileNotFoundError:
        pass  # the model is not visible from the submit host and inference serves "auto": keep the configured dtype
    return {"trainer": trainer, "orchestrator": orchestrator, "inference": inference}
