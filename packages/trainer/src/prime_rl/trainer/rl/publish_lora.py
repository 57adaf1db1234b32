"""Publish only the LoRA adapter after each step, in peft format, for inference to load by name.

With `[model.lora]` the base never changes, so a version is the adapter alone: `broadcasts/step_<n>/` holds
`adapter_config.json` + `adapter_model.safetensors` (peft's layout, what vLLM's `load_lora_adapter` reads) and
`prime_rl_adapter.json` ({"name", "version"}: the name inference serves it under), written into `step_<n>.tmp/`,
fsynced, marked `STABLE` and renamed into place, exactly like the full-weight filesystem publisher, then
announced (`WeightsPublished`) to the orchestrator, which has inference load it as it loads full weights.

Bytes per update: 2 * r * (in + out) per adapted layer in the publish dtype (Qwen3-1.7B, r=16 on every
linear layer, bf16: ~35 MB instead of 3.4 GB of full weights). The gather and the cast are collective and on
the loop (adapters are small); the device-to-host copy goes through the full-weight publisher's staging
(``weights.staging.HostStaging``: one reusable pinned buffer, a side stream, no host sync on the loop; copying
~400 adapter tensors one `.cpu()` at a time blocked an H200 RL step for 0.5 s, and one synchronous flat copy
still 0.41 s); the write waits for the copy in a background thread, one version in flight (the next `publish`
waits for it).

Left out: pushing adapters over NCCL / NIXL (vLLM loads LoRA adapters from a path; `add_lora` from tensors
is not exposed on its HTTP server), and `modules_to_save` (vLLM serves adapters only; the config refuses it).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from prime_rl.common.config.rl_trainer import FilesystemBroadcastConfig
from prime_rl.common.lora import ADAPTER_META, ADAPTER_WEIGHTS
from prime_rl.common.rundir import BROADCAST_MARKER, RunDir
from prime_rl.trainer.lora import adapter_config, peft_state_dict, write_adapter_dir
from prime_rl.trainer.model import CausalLM
from prime_rl.trainer.rl.publish_base import Publisher, prune_versions
from prime_rl.trainer.weights.files import publish_dir, remove_partial_dirs, tmp_dir_of
from prime_rl.trainer.weights.staging import HostStaging, gather_full_tensors
from prime_rl.trainer.world import World

logger = logging.getLogger(__name__)


def adapter_name(model: CausalLM, run_dir: RunDir) -> str:
    """`model.lora.name`, or the run name."""
    return model.model.lora_config.name or run_dir.root.name


class LoRAPublisher(Publisher):
    """Adapter-only filesystem versions (see the module docstring); the base is what inference already serves."""

    def __init__(self, cfg: FilesystemBroadcastConfig, run_dir: RunDir, model: CausalLM, world: World, name: str):
        super().__init__(cfg, model, world, "adapter writer")
        self.run_dir = run_dir
        self.name = name
        options = StateDictOptions(full_state_dict=False, ignore_frozen_params=True)
        # the trainable tensors (possibly sharded), in model names; updated in place, so built once
        self.state = {k.removeprefix("model."): v for k, v in get_model_state_dict(model, options=options).items()}
        self.adapter_config = adapter_config(model.model, str(model.config.source_dir or ""))
        self.staging = HostStaging(world.device) if world.is_main else None
        self.last_bytes = 0
        """Bytes of the last published adapter file."""
        if world.is_main:
            for path in remove_partial_dirs(run_dir.broadcasts_dir):
                logger.warning("removed %s, an adapter version a previous trainer did not finish writing", path)

    def publish(self, version: int) -> float:
        """Collective (the gather). Returns the seconds the loop was blocked; the copy to the host and the write
        go on in the background."""
        start = time.perf_counter()
        self.flush()  # one version in flight: its write has read the buffer this capture overwrites
        tensors = gather_full_tensors(self.state, self.dtype, keep=self.staging is not None, cast_on_cpu=False)
        if self.staging is None:
            for _ in tensors:  # join every all-gather
                pass
            return time.perf_counter() - start
        self.staging.capture(self.state, tensors, self.dtype)
        blocked = time.perf_counter() - start
        self.job.start(lambda: self._write(version, blocked))
        return blocked

    def _write(self, version: int, blocked: float) -> None:
        start = time.perf_counter()
        assert self.staging is not None
        self.staging.wait()
        tensors = self.staging.tensors()
        final = self.run_dir.broadcast_dir(version)
        tmp = tmp_dir_of(final)
        shutil.rmtree(tmp, ignore_errors=True)
        write_adapter_dir(tmp, peft_state_dict(tensors, self.model.config), self.adapter_config)
        (tmp / ADAPTER_META).write_text(json.dumps({"name": self.name, "version": version}) + "\n")
        for path in tmp.iterdir():
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
        (tmp / BROADCAST_MARKER).touch()
        publish_dir(tmp, final)
        self.last_bytes = (final / ADAPTER_WEIGHTS).stat().st_size
        prune_versions(self.run_dir, version, self.cfg.keep_last)
        self.last_write_time = time.perf_counter() - start
        self._announce(version, str(final), blocked)


def build_lora_publisher(
    cfg: FilesystemBroadcastConfig, run_dir: RunDir, model: CausalLM, world: World
) -> LoRAPublisher:
    if not isinstance(cfg, FilesystemBroadcastConfig):
        raise ValueError(
            f"weight_broadcast.type={cfg.type!r} with model.lora: adapters are published through the filesystem "
            'only (vLLM loads LoRA adapters from a path); set weight_broadcast.type = "filesystem"'
        )
    return LoRAPublisher(cfg, run_dir, model, world, adapter_name(model, run_dir))
