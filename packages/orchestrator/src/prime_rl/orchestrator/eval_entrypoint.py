"""`eval @ eval.toml [--section.key value ...]`: evaluate a served model (base or checkpoint) on environments.

Start `inference` on the model or checkpoint to evaluate, then point `model.client.base_url` at it.
Results: `<output_dir>/<run_name>/evals/step_<step>/<env>/samples.jsonl` (every rollout) and one row of
`eval/<env>/{reward_mean,pass@<k>,...}` at `step` in `monitors/file/metrics.jsonl`; a summary line per
environment on the console. Bad input (unknown environment, missing package, template without tools)
is one line and exit code 1 before any rollout.
"""

from __future__ import annotations

import logging

from prime_rl.common.config import parse_config
from prime_rl.common.config.eval import EvalConfig
from prime_rl.common.config.orchestrator import SamplingConfig
from prime_rl.common.rundir import RunDir
from prime_rl.orchestrator.entrypoint import run_command

# As in entrypoint.py: the runtime (httpx, the environments) is imported by `run`, not for --help.

logger = logging.getLogger(__name__)


def evals_dir(run_dir: RunDir, step: int):
    return run_dir.root / "evals" / f"step_{step}"


async def run(config: EvalConfig) -> dict[str, float]:
    from prime_rl.common.monitor import FileMonitor
    from prime_rl.orchestrator.client import InferenceClient, SamplingArgs
    from prime_rl.orchestrator.entrypoint import build_env_handles
    from prime_rl.orchestrator.evaluate import run_evals
    from prime_rl.orchestrator.scheduler import start_envs

    run_dir = RunDir(config.output_dir, config.run_name)
    client = InferenceClient.from_config(config.model)
    envs = build_env_handles(config.env)
    try:
        renderers = await start_envs(envs, client, config.model.chat_template, config.model.tool_call_parser)
        sampling = SamplingArgs.from_config(config.sampling or SamplingConfig(), config.model.chat_template)
        metrics = await run_evals(client, envs, renderers, config, sampling, max_len=config.seq_len,
                                  out_dir=evals_dir(run_dir, config.step), max_concurrent=config.max_concurrent)  # fmt: skip
    finally:
        for env in envs:
            await env.close()
        await client.aclose()
    with FileMonitor(run_dir) as monitor:
        monitor.log(config.step, metrics)
    for env in envs:
        keys = sorted(k for k in metrics if k.startswith(f"eval/{env.name}/"))
        logger.info("%s | %s", env.name, " | ".join(f"{k.rsplit('/', 1)[1]} {metrics[k]:.3f}" for k in keys))
    return metrics


def main(argv: list[str] | None = None) -> None:
    run_command("eval", parse_config(EvalConfig, argv, prog="eval"), run)


if __name__ == "__main__":
    main()
