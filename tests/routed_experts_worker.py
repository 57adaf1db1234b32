"""Sample from a model with vLLM asking for routed experts; write prompt, tokens, logprobs and experts as JSON.

    python tests/routed_experts_worker.py MODEL_DIR OUT.json

Run by tests/test_router_replay_gpu.py in its own process (vLLM spawns processes: the engine is built under
``__main__``). The engine settings for routed experts come from `prime_rl.common.vllm_compat`.
"""

from __future__ import annotations

import json
import os
import sys

from prime_rl.common import vllm_compat as vc

if __name__ == "__main__":
    model_dir, out = sys.argv[1], sys.argv[2]
    version = vc.installed_vllm_version()
    for key, value in vc.routed_experts_env(version).items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams

    llm = LLM(
        model_dir, dtype="bfloat16", max_model_len=256, seed=0, enable_prefix_caching=True,
        gpu_memory_utilization=0.3, logprobs_mode=vc.PROCESSED_LOGPROBS, **{vc.ROUTED_EXPERTS_ENGINE_ARG: True},
    )  # fmt: skip
    prompts = [{"prompt_token_ids": list(range(10 + i, 40 + i))} for i in range(4)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, logprobs=0, temperature=1.0, ignore_eos=True))
    rows = []
    for output in outputs:
        completion = output.outputs[0]
        experts = completion.routed_experts
        rows.append(
            {
                "prompt_ids": list(output.prompt_token_ids),
                "token_ids": list(completion.token_ids),
                "logprobs": [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)],
                "routed_experts": None if experts is None else experts.astype(int).tolist(),
                "dtype": None if experts is None else str(experts.dtype),
            }
        )
    with open(out, "w") as f:
        json.dump({"version": version, "rows": rows}, f)
