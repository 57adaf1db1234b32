"""On-policy distillation: a teacher server scores the tokens the student sampled.

For each sampled completion y of prompt x, the teacher (a second OpenAI-compatible vLLM server, e.g. a
larger model with the same tokenizer) is asked for log p_T(y_t | x, y_<t) of exactly the sampled ids:
one `/v1/completions` request whose prompt is the token ids x + y, with `prompt_logprobs = 0` (vLLM
then returns the logprob of each prompt token itself) and `max_tokens = 1` (the generated token is
ignored). Each completion token's advantage then gets

    coef * (log p_T(y_t) - log p_S(y_t))

where log p_S is the sampler's own logprob (already returned with the rollout). Its expectation under
the student is -coef * KL(p_S || p_T), so the policy gradient descends the per-token reverse KL to
the teacher (the on-policy distillation objective); the reward advantage is added on top, scaled by
`teacher.reward_weight` (0: distillation alone).

Why token ids and the completions API: the student's tokens are scored exactly (no re-tokenization
drift), and the teacher needs no chat template. The teacher must share the student's vocabulary.
Cost: one prefill of prompt + completion per sample on the teacher; no sampling there.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from prime_rl.common.config.orchestrator import TeacherConfig
from prime_rl.orchestrator.client import InferenceClient, InferenceError, InferenceUnreachableError
from prime_rl.orchestrator.rollout import Completion


class TeacherClient(InferenceClient):
    """`await teacher.logprobs(prompt_ids, completion_ids)` -> the teacher's logprob of each completion id."""

    def __init__(self, base_url: str, model: str, **kwargs: Any) -> None:
        super().__init__(base_url, model, **kwargs)
        self.url = f"{self.base_url}/completions"

    def build_logprob_request(self, prompt_ids: list[int], completion_ids: list[int]) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": [*prompt_ids, *completion_ids],
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0,
            "add_special_tokens": False,
        }

    async def logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        try:
            data = await self._post(self.build_logprob_request(prompt_ids, completion_ids))
        except InferenceUnreachableError as e:
            raise InferenceUnreachableError(f"teacher: {e} (teacher: check orchestrator.teacher.base_url)") from e
        return parse_prompt_logprobs(data, [*prompt_ids, *completion_ids], len(prompt_ids))


def parse_prompt_logprobs(data: dict[str, Any], token_ids: list[int], start: int) -> list[float]:
    """Logprobs of `token_ids[start:]` from a vLLM completions body with `prompt_logprobs`."""
    choices = data.get("choices") or []
    entries = choices[0].get("prompt_logprobs") if choices else None
    if entries is None:
        raise InferenceError("teacher response has no choices[0].prompt_logprobs; the teacher must be a vLLM server")
    if len(entries) != len(token_ids):
        raise InferenceError(
            f"teacher returned {len(entries)} prompt logprobs for {len(token_ids)} prompt tokens; it must be "
            "served with the student's tokenizer and a max_model_len that fits prompt + completion + 1"
        )
    logprobs = []
    for position in range(start, len(token_ids)):
        entry = entries[position] or {}
        scored = entry.get(str(token_ids[position]))
        if scored is None:
            raise InferenceError(f"teacher prompt_logprobs at position {position} lack token {token_ids[position]}")
        logprobs.append(float(scored["logprob"]))
    return logprobs


class Distiller:
    """Per-token distillation advantages for one group, and their running metrics."""

    def __init__(self, client: TeacherClient, coef: float, reward_weight: float = 1.0) -> None:
        self.client, self.coef, self.reward_weight = client, coef, reward_weight
        self._reverse_kl: list[float] = []  # per completion: mean over tokens of log p_S - log p_T
        self._teacher_logprob: list[float] = []

    @classmethod
    def from_config(cls, config: TeacherConfig) -> Distiller:
        client = TeacherClient(
            config.base_url,
            config.model,
            api_key=config.api_key,
            timeout=config.timeout,
            max_retries=config.max_retries,
        )
        return cls(client, config.coef, config.reward_weight)

    async def token_advantages(self, prompt_ids: list[int], completions: list[Completion]) -> list[list[float]]:
        """coef * (teacher logprob - sampler logprob) for every token of every completion."""
        teacher = await asyncio.gather(*(self.client.logprobs(prompt_ids, c.token_ids) for c in completions))
        out = []
        for completion, teacher_lp in zip(completions, teacher):
            student_lp = np.asarray(completion.logprobs, dtype=np.float64)
            diff = np.asarray(teacher_lp, dtype=np.float64) - student_lp  # (T,)
            if len(diff):
                self._reverse_kl.append(float(-diff.mean()))
                self._teacher_logprob.append(float(np.mean(teacher_lp)))
            out.append([float(self.coef * d) for d in diff])
        return out

    def pop_metrics(self) -> dict[str, float]:
        metrics = {}
        if self._reverse_kl:
            metrics["distill/reverse_kl"] = float(np.mean(self._reverse_kl))
            metrics["distill/teacher_logprob_mean"] = float(np.mean(self._teacher_logprob))
        self._reverse_kl, self._teacher_logprob = [], []
        return metrics

    async def aclose(self) -> None:
        await self.client.aclose()
