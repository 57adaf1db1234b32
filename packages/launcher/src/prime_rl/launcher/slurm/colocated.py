"""vLLM's share of each GPU in a colocated SLURM job, sized on the job's first node (rl.sbatch.j2 runs it there).

`python -m prime_rl.launcher.slurm.colocated <job's rl.toml>` prints the share (`gpu_memory_utilization`) that
leaves room for the resting trainer (`prime_rl.launcher.colocate.vllm_share`), or nothing where it cannot be
read (no GPU, no checkpoint: vLLM keeps the configured share); a vLLM that cannot sleep or a model that does not
fit is one line on stdout and exit 2, which ends the job naming it. The submit host may have no GPU and no model,
so a local run's sizing (`rl.check_colocated`) runs here instead, on a node the job's GPUs are like.

A share the user set is kept. The job's config is `rl`'s hand-off, with every default written out, so a set value
cannot be told from a written default there (as for the served dtype, `resolution._dtype_changes`): vLLM's default
(0.9, which ran the KV cache's wake out of memory beside a resting trainer on the H200) is the one sized.
"""

from __future__ import annotations

import shutil
import sys

from prime_rl.common.config import ConfigError, load_config
from prime_rl.common.config.inference import VLLMConfig
from prime_rl.common.config.rl import RLConfig
from prime_rl.launcher.colocate import ipc_slot_bytes, vllm_share
from prime_rl.launcher.host_facts import HostFacts
from prime_rl.launcher.rl import check_colocated, visible_gpus


def sized_share(cfg: RLConfig, gpus: list[str]) -> float | None:
    """The share for ``cfg`` on this node's ``gpus``; None: keep the configured one. Raises ConfigError."""
    facts = check_colocated(cfg, gpus, HostFacts())
    if cfg.inference.vllm.gpu_memory_utilization != VLLMConfig.model_fields["gpu_memory_utilization"].default:
        return None  # the user's
    if facts.gpu_bytes is None or facts.num_params is None:
        return None
    return vllm_share(facts.gpu_bytes, facts.num_params, cfg.deployment.num_ranks, ipc_slot_bytes(cfg))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m prime_rl.launcher.slurm.colocated RL_TOML", file=sys.stderr)
        return 2
    try:
        # no NVIDIA driver here (a CPU node whose GRES are stand-ins, as on tests/slurm's cluster): nothing to size
        gpus = visible_gpus() if shutil.which("nvidia-smi") else []
        share = sized_share(load_config(RLConfig, ["@", args[0]]), gpus)
    except ConfigError as e:
        print(f"colocated: {e}")
        return 2
    if share is not None:
        print(share)
    return 0


if __name__ == "__main__":
    sys.exit(main())
