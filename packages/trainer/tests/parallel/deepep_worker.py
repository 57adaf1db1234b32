"""One rank of the DeepEP dispatch tests (run under torchrun by test_deepep.py).

Installs the `deep_ep` test double (deep_ep_double.py) before the trainer imports it, and lifts the
CUDA + NCCL gate, which the double does not need (test_deepep.py checks the gate on its own). Then runs
the scaling worker's variants and records, per variant, which DeepEP calls ran.

argv: out.pt, then a JSON list of {"name", "model_dir", "flags"}.
"""

import json
import sys

import deep_ep_double
import torch

sys.modules["deep_ep"] = deep_ep_double

import scaling_worker  # noqa: E402

from prime_rl.trainer.parallel import deepep  # noqa: E402
from prime_rl.trainer.world import close_world, exit_rank, init_world  # noqa: E402


def main(out: str, variants: list[dict]) -> None:
    deepep.check_deepep_runtime = lambda device_type, backend: None  # gloo CPU stands in for NCCL GPUs
    world = init_world()
    results = {}
    for v in variants:
        deep_ep_double.Buffer.stats.clear()
        deep_ep_double.Buffer.instances.clear()
        result = scaling_worker.run_variant(world, v["model_dir"], v["flags"])
        result["deep_ep"] = {
            **deep_ep_double.Buffer.stats,
            "buffers": len(deep_ep_double.Buffer.instances),
            "num_sms": deep_ep_double.Buffer.num_sms,
        }
        results[v["name"]] = result
    if world.rank == 0:
        torch.save(results, out)
    close_world()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
    exit_rank(0)  # a finished rank skips interpreter finalization (see exit_rank)
