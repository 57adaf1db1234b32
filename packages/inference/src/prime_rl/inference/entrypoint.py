"""``inference @ infer.toml [--section.key value ...]``: one vLLM server, or replicas behind a router."""

from __future__ import annotations

import sys

from prime_rl.common.config import parse_config
from prime_rl.common.config.inference import InferenceConfig
from prime_rl.common.config.slurm_route import run_through_slurm, wants_slurm
from prime_rl.common.logging import setup_logger
from prime_rl.inference.preflight import apply_cpu_defaults, check_inference
from prime_rl.inference.vllm_api import UnsupportedVLLM, check_vllm


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if wants_slurm(argv):  # multi-node: one replica per node behind a router, through sbatch
        sys.exit(run_through_slurm("inference", argv, "inference"))
    config = parse_config(InferenceConfig, argv, prog="inference", check=check_inference)
    # Our own INFO lines (every pause / resume / weight load with its origin, refused messages, restores)
    # go to stderr, i.e. logs/.../inference.log under the launcher; vLLM keeps its own logging.
    setup_logger("prime_rl")
    try:  # one line naming the supported range, before any engine (or replica) starts
        check_vllm()
    except UnsupportedVLLM as e:
        sys.stderr.write(f"inference: error: {e}\n")
        raise SystemExit(2) from None
    apply_cpu_defaults(config)
    if config.fronted_by_router:
        from prime_rl.inference.router import run_replicas

        sys.exit(run_replicas(config))

    import uvloop

    from prime_rl.inference.server import serve

    uvloop.run(serve(config))


if __name__ == "__main__":
    main()
