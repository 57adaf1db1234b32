"""Serving LoRA adapters: vLLM's flags for `[lora]`, and loading / replacing a published adapter by name.

A LoRA RL trainer publishes each version as a peft adapter directory (`broadcasts/step_<n>/`: adapter_config.json,
adapter_model.safetensors, `prime_rl_adapter.json` with the served name, and the `STABLE` marker). The
orchestrator sends the same `LoadWeightsRequest(path, version)` it sends for full weights; the controller hands
adapter directories to `load_adapter`, which:

1. checks the directory (marker, peft config, name, rank <= the server's max_rank) before anything changes;
2. pauses generation unless the client already paused (the controller's pause mode);
3. loads the adapter under its name with vLLM's own `/v1/load_lora_adapter` (`load_inplace`: same name, same
   LoRA id, new weights), the one call that also registers the name with the OpenAI API, so requests with
   `"model": "<name>"` use it; the base weights are untouched;
4. resets the prefix cache, preempting running requests (their KV, and cached prompts under that LoRA id, were
   computed with the previous adapter), sets the engine's weight version, resumes.

Several adapters can be served at once over one base (`max_loras` per batch, `adapters` loaded at start), so
side-by-side runs can share one inference fleet, each publishing under its own name.

Left out: per-adapter weight versions. The engine has one version tag; with several runs publishing to one
server the tag is the last update's, so a run's orchestrator should trust its own announcements.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from prime_rl.common.config.inference import InferenceConfig, InferenceLoRAConfig
from prime_rl.common.lora import ADAPTER_CONFIG, ADAPTER_META, ADAPTER_WEIGHTS
from prime_rl.common.wire import ControlReply, LoadWeightsRequest

if TYPE_CHECKING:
    from prime_rl.inference.control import Controller

logger = logging.getLogger(__name__)


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def write_identity_adapter(out_dir: Path, hf_config: Any) -> Path:
    """A rank-1 peft adapter with B = 0 on layer 0's o_proj: under its name the server answers exactly as the
    base model does. Serves a LoRA RL policy's name at step 0, before the trainer's first version replaces it."""
    import torch
    from safetensors.torch import save_file

    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    prefix = "base_model.model.model.layers.0.self_attn.o_proj"
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"{prefix}.lora_A.weight": torch.zeros(1, heads * head_dim),
        f"{prefix}.lora_B.weight": torch.zeros(hidden, 1),
    }
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 1, "lora_alpha": 1, "target_modules": ["o_proj"]}
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config) + "\n")
    return out_dir


def apply_lora_args(args: argparse.Namespace, cfg: InferenceLoRAConfig | None) -> None:
    """vLLM's LoRA flags from `[lora]` (nothing without it), plus runtime loading by name."""
    if cfg is None:
        return
    from vllm.entrypoints.openai.models.protocol import LoRAModulePath

    args.enable_lora = True
    args.max_lora_rank = cfg.max_rank
    args.max_loras = cfg.max_loras
    modules = [LoRAModulePath(name=n, path=p) for n, p in cfg.adapters.items()]
    if cfg.placeholders:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(args.model)
        root = Path(tempfile.mkdtemp(prefix="prime_rl_lora_"))
        for name in cfg.placeholders:
            modules.append(LoRAModulePath(name=name, path=str(write_identity_adapter(root / name, hf_config))))
    args.lora_modules = modules or None
    # vLLM registers /v1/load_lora_adapter only with this set; it is how published adapters get their name
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"


class AdapterLoader:
    """Loads adapters through the server's own HTTP API (vLLM keeps the name -> adapter table of its OpenAI
    endpoints there, out of reach of the engine object)."""

    def __init__(self, base_url: str, api_key: str | None, max_rank: int) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.max_rank = max_rank

    @classmethod
    def for_server(cls, config: InferenceConfig, port: int) -> AdapterLoader | None:
        if config.lora is None:
            return None
        host = config.server.host
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        api_key = config.server.api_key or os.environ.get("VLLM_API_KEY")
        return cls(f"http://{host}:{port}", api_key, config.lora.max_rank)

    def read(self, path: str, marker: str) -> tuple[str, int]:
        """(name, rank) of a published adapter directory; ValueError (value, rule, fix) when it cannot be served."""
        root = Path(path)
        if not (root / marker).is_file():
            raise ValueError(
                f"{path} has no {marker} marker: the adapter is not completely written; load it once it is"
            )
        if not (root / ADAPTER_WEIGHTS).is_file():
            raise ValueError(
                f"{path} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}; publish the adapter in peft format"
            )
        if not (root / ADAPTER_META).is_file():
            raise ValueError(
                f"{path} has no {ADAPTER_META} naming the adapter; it is written by the LoRA RL trainer "
                "(serve other adapters with [lora] adapters = {name = path})"
            )
        name = json.loads((root / ADAPTER_META).read_text())["name"]
        rank = int(json.loads((root / ADAPTER_CONFIG).read_text())["r"])
        if rank > self.max_rank:
            raise ValueError(
                f"adapter {name!r} at {path} has rank {rank} > this server's lora.max_rank={self.max_rank}; "
                f"restart inference with lora.max_rank >= {rank}"
            )
        return name, rank

    async def load(self, name: str, path: str) -> None:
        async with httpx.AsyncClient(timeout=600.0, headers=self.headers) as client:
            r = await client.post(
                f"{self.base_url}/v1/load_lora_adapter",
                json={"lora_name": name, "lora_path": path, "load_inplace": True},
            )
        if r.status_code != 200:
            raise RuntimeError(f"vLLM refused adapter {name!r} from {path}: HTTP {r.status_code}: {r.text[:500]}")


async def load_adapter(controller: Controller, request: LoadWeightsRequest) -> ControlReply:
    """Load (or replace in place) the adapter in ``request.path`` under its name, as version ``request.version``."""
    loader: AdapterLoader | None = getattr(controller, "adapters", None)
    if loader is None:
        return controller._reply(
            False,
            f"{request.path} is a LoRA adapter but this server was started without LoRA support; restart inference "
            "with [lora] (max_rank >= the adapter's rank) to serve adapters",
        )
    try:
        name, rank = loader.read(request.path, controller.marker)
    except ValueError as e:
        return controller._reply(False, str(e))
    engine = controller.engine
    async with controller._lock:
        paused_here = not controller._client_paused
        if paused_here:
            await engine.pause_generation(mode=controller.pause_mode)
        try:
            try:
                await loader.load(name, request.path)
            except Exception as e:  # the previous adapter (if any) keeps serving under the name
                logger.error("%s", e)
                return controller._reply(False, str(e))
            # running requests and cached prompts under this adapter's id were computed with its old weights
            await engine.reset_prefix_cache(reset_running_requests=True)
            await controller.label_version(request.version)
            controller.weight_version = request.version
        finally:
            if paused_here:
                await engine.resume_generation()
    logger.info("loaded LoRA adapter %r (rank %d) version %d from %s", name, rank, request.version, request.path)
    return controller._reply(True)
