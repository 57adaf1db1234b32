"""`type = "verifiers"` without a server: a verifiers (v1) taskset loaded by id, its tools executed, its rubric
scoring the conversation; faults in worker processes fail one rollout; bad input is one line before any
rollout. The tasksets are in vf_envs/ (the vLLM-backed proof with examples/verifiers_env is
tests/test_verifiers_vllm.py). Skips without verifiers, which is an optional extra of this package."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from prime_rl.common.config.orchestrator import OrchestratorConfig
from prime_rl.orchestrator.envs.handle import Budget, EnvCrashed, EnvTimeout, LocalEnv
from prime_rl.orchestrator.envs.registry import build_environment
from prime_rl.orchestrator.envs.worker import WorkerEnv
from prime_rl.orchestrator.tools import ToolCall

VF_ENVS = Path(__file__).parent / "vf_envs"
needs_verifiers = pytest.mark.skipif(
    importlib.util.find_spec("verifiers") is None,
    reason="needs verifiers (pip install 'prime-rl-orchestrator[verifiers]')",
)
TOOLS = {"type": "verifiers", "id": "vf-faulty", "args": {"task": {"tools": True}}}


@pytest.fixture(autouse=True)
def importable_vf_envs(monkeypatch):
    """Worker processes (and this one) import the test tasksets from vf_envs/."""
    monkeypatch.syspath_prepend(str(VF_ENVS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(VF_ENVS), os.environ.get("PYTHONPATH")])))


def build(entry: dict):
    return build_environment(OrchestratorConfig(env=[entry]).env[0])


def test_config_names_the_env_by_its_id():
    config = OrchestratorConfig(env=[TOOLS, {**TOOLS, "name": "vf2", "max_turns": 3}])
    assert [e.resolved_name for e in config.env] == ["vf-faulty", "vf2"]
    assert config.env[0].args == {"task": {"tools": True}} and config.env[1].max_turns == 3
    with pytest.raises(ValueError, match="id"):
        OrchestratorConfig(env=[{"type": "verifiers"}])


@needs_verifiers
def test_tool_taskset_prompts_tools_and_rubric():
    env = build(TOOLS)
    (schema,) = env.tools
    assert schema["function"]["name"] == "adder_add"  # verifiers' `<server>_<tool>` naming
    assert schema["function"]["parameters"]["required"] == ["a", "b"]
    tasks = env.sample_tasks(3, np.random.default_rng(0))
    assert tasks == env.sample_tasks(3, np.random.default_rng(0))  # all randomness from the rng
    task = tasks[0]
    answer = task["data"]["answer"]
    prompt = env.build_prompt(task)
    assert prompt == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"{answer - 1} + 1?"},
    ]
    call = ToolCall("call_0", "adder_add", {"a": answer - 1, "b": 1}, "raw")
    messages = prompt + [{"role": "assistant", "content": "", "tool_calls": [call.to_message()]}]
    reply = env.env_response(task, messages, [call])  # an async @vf.tool, run to completion
    assert reply == [{"role": "tool", "tool_call_id": "call_0", "content": str(answer)}]
    assert env.env_response(task, messages, []) is None  # no call: the answer
    again = messages + reply + [{"role": "assistant", "content": "", "tool_calls": [call.to_message()]}]
    assert env.env_response(task, again, [call]) is None  # the taskset's @vf.stop: two tool results are enough
    done = messages + reply + [{"role": "assistant", "content": str(answer)}]
    assert env.score_rollout(task, done) == 2.0  # the rubric's weight
    assert env.score_rollout(task, messages + reply + [{"role": "assistant", "content": "no"}]) == 0.0


@needs_verifiers
def test_taskset_without_tools_is_one_turn():
    env = build({"type": "verifiers", "id": "vf-faulty", "args": {"num_tasks": 2}})
    assert env.tools == [] and len(env.tasks) == 2
    task = env.sample_tasks(1, np.random.default_rng(1))[0]
    assert env.score(task, str(task["data"]["answer"])) == 2.0 and env.score(task, "7 apples") == 0.0


@needs_verifiers
def test_threads_in_the_orchestrator_loop():
    """`workers = 0`: the environment is built inside the orchestrator's running event loop and called from
    threads; verifiers' coroutines (toolset setup, tools, rubric) still run to completion."""

    async def go():
        env = LocalEnv(build(TOOLS), "vf", timeout=30.0)
        task = (await env.sample_tasks(1, seed=0))[0]
        call = ToolCall("call_0", "adder_add", {"a": 2, "b": 3}, "raw")
        messages = [
            {"role": "user", "content": "?"},
            {"role": "assistant", "content": "", "tool_calls": [call.to_message()]},
        ]
        reply = await env.env_response(task, messages, [call])
        done = messages + reply + [{"role": "assistant", "content": str(task["data"]["answer"])}]
        return reply, await env.score(task, "", done)

    reply, score = asyncio.run(go())
    assert reply[0]["content"] == "5" and score.reward == 2.0 and not score.failed


@needs_verifiers
def test_faulty_rubric_in_a_worker_fails_only_that_rollout():
    async def go():
        env = WorkerEnv(TOOLS, "vf", timeout=4.0, num_workers=1)
        await env.start()
        try:
            assert env.info.multi_turn and env.info.tools[0]["function"]["name"] == "adder_add"
            task = (await env.sample_tasks(1, seed=0))[0]
            right = str(task["data"]["answer"])

            def said(text):
                return [{"role": "user", "content": "?"}, {"role": "assistant", "content": text}]

            assert (await env.score(task, right, said(right))).reward == 2.0
            raised = await env.score(task, "RAISE", said("RAISE"))  # counted as failed, same worker
            assert raised.failed and "reward function failed" in raised.error
            ready = Budget(120.0)  # a fresh worker imports verifiers first: seconds on a loaded machine
            with pytest.raises(EnvTimeout):
                await env.score(task, "HANG", said("HANG"))
            await env.call("info", {}, ready)
            with pytest.raises(EnvCrashed):
                await env.score(task, "CRASH", said("CRASH"))
            await env.call("info", {}, ready)
            assert (await env.score(task, right, said(right))).reward == 2.0  # a fresh worker goes on
            return env.pop_counters(), env.restarts
        finally:
            await env.close()

    counters, restarts = asyncio.run(go())
    assert counters["timeouts"] == 1 and counters["crashes"] == 1 and restarts == 2


@needs_verifiers
def test_bad_input_is_one_line_before_any_rollout():
    async def start(entry):
        env = WorkerEnv(entry, "bad", timeout=5.0)
        with pytest.raises(ValueError) as e:
            await env.start()
        assert not env.workers
        return str(e.value)

    unknown = asyncio.run(start({"type": "verifiers", "id": "no-such-vf-env"}))
    assert "'no-such-vf-env' is not installed (no module 'no_such_vf_env')" in unknown and "\n" not in unknown
    with pytest.raises(ModuleNotFoundError, match="installed but importing it failed.*no_such_dependency"):
        build({"type": "verifiers", "id": "vf-broken-dep"})
    with pytest.raises(ValueError, match=r"do not fit its taskset config \(taskset.num_tasks: .*integer") as e:
        build({"type": "verifiers", "id": "vf-faulty", "args": {"num_tasks": "many"}})
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"rewards \['tests_pass'\] need a runtime"):
        build({"type": "verifiers", "id": "vf-sandboxed"})


def test_missing_verifiers_package_says_what_to_install(monkeypatch):
    from importlib.metadata import PackageNotFoundError

    from prime_rl.orchestrator.envs import verifiers_env

    def not_installed(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(verifiers_env, "version", not_installed)
    with pytest.raises(
        ImportError, match=r"needs the verifiers package.*pip install 'prime-rl-orchestrator\[verifiers\]'"
    ):
        verifiers_env.import_verifiers()
