"""`orchestrator @ orch.toml [--section.key value ...]`: run the RL orchestrator."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prime_rl.common.config import parse_config, write_toml
from prime_rl.common.config.orchestrator import EnvConfig, OrchestratorConfig
from prime_rl.common.env import STDOUT_IS_LOG_ENV
from prime_rl.common.logging import setup_logger
from prime_rl.common.rundir import RunDir

if TYPE_CHECKING:
    from prime_rl.common.config.eval import EvalConfig
    from prime_rl.orchestrator.envs.handle import EnvHandle
    from prime_rl.orchestrator.weights import InferenceControl

# The runtime (httpx, numpy, ZeroMQ, the environments: ~0.6 s) is imported in the functions that start a
# run, so that `orchestrator --help` and bad-config errors need only the config schema.


def build_control(config: OrchestratorConfig) -> InferenceControl:
    from prime_rl.orchestrator.weights import NoInferenceControl, ZmqInferenceControl

    if not config.inference.addresses:
        return NoInferenceControl()
    return ZmqInferenceControl(config.inference.addresses, timeout=config.inference.timeout)


def build_env_handles(entries: list[EnvConfig]) -> list[EnvHandle]:
    """One handle per `[[orchestrator.env]]` entry: worker processes (workers >= 1) or threads here (0)."""
    from prime_rl.orchestrator.envs import build_environment
    from prime_rl.orchestrator.envs.handle import LocalEnv
    from prime_rl.orchestrator.envs.worker import WorkerEnv

    handles: list[EnvHandle] = []
    for entry in entries:
        name, weight, timeout = entry.resolved_name, entry.weight, entry.timeout
        if entry.workers > 0:
            handles.append(WorkerEnv(entry.model_dump(mode="json"), name, weight, timeout, entry.workers))
        else:
            handles.append(LocalEnv(build_environment(entry), name, weight, timeout))
    return handles


async def run(config: OrchestratorConfig) -> None:
    from prime_rl.common.monitor import build_monitor
    from prime_rl.orchestrator.batch import BatchSender
    from prime_rl.orchestrator.client import InferenceClient
    from prime_rl.orchestrator.orchestrator import Orchestrator
    from prime_rl.orchestrator.teacher import Distiller

    run_dir = RunDir(config.output_dir, config.run_name)
    envs = build_env_handles(config.env)
    eval_envs = build_env_handles(config.eval.env) if config.eval is not None and config.eval.env else None
    client = InferenceClient.from_config(config.model, routed_experts=config.routed_experts)
    control = build_control(config)
    sender = BatchSender(
        config.trainer.address, config.trainer.port, config.num_train_ranks, config.trainer.send_timeout
    )
    monitor = build_monitor(run_dir, config.monitor, "orchestrator", config.model_dump(mode="json"))
    teacher = Distiller.from_config(config.teacher) if config.teacher is not None else None
    try:
        orchestrator = Orchestrator(
            config, envs, client, control, sender.send, monitor, teacher=teacher, eval_envs=eval_envs
        )
        await orchestrator.run()
    finally:
        await client.aclose()
        if teacher is not None:
            await teacher.aclose()
        control.close()
        sender.close()
        monitor.close()


def _log_file(run_dir: RunDir):
    if os.environ.get(STDOUT_IS_LOG_ENV) == "1":
        return None  # the launcher already sends our console into logs/latest/orchestrator.log
    try:
        return run_dir.log_path("orchestrator")  # the launcher started an attempt
    except FileNotFoundError:
        return run_dir.logs_dir / "orchestrator.log"


def run_command(
    name: str,
    config: OrchestratorConfig | EvalConfig,
    run: Callable[..., Coroutine[Any, Any, object]],
    log_file: Callable[[RunDir], Path | None] = lambda run_dir: None,
) -> None:
    """`orchestrator` and `eval` once their config is parsed. With `dry_run`: write it to
    <run_dir>/configs/<name>.toml, print the path and return. Else set up logging and run `run(config)` to its end:
    Ctrl-C exits 130; an error is one line on the console (its traceback goes to the log at debug level), exit 1."""
    run_dir = RunDir(config.output_dir, config.run_name)
    if config.dry_run:
        print(write_toml(config, run_dir.config_path(name)))
        return
    import asyncio  # with the runtime: --help and --dry-run never need it

    logger = setup_logger("prime_rl", log_file=log_file(run_dir), level=config.log_level)
    try:
        asyncio.run(run(config))
    except KeyboardInterrupt:
        logger.info("interrupted")
        sys.exit(130)
    except Exception as e:  # one clear line for the operator; the traceback goes to the log file
        logger.debug("%s failed", name, exc_info=True)
        logger.error("%s failed: %s: %s", name, type(e).__name__, e)
        logging.shutdown()
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    run_command("orchestrator", parse_config(OrchestratorConfig, argv, prog="orchestrator"), run, _log_file)


if __name__ == "__main__":
    main()
