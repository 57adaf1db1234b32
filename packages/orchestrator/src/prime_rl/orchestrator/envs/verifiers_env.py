"""`type = "verifiers"`: an installed verifiers environment package (verifiers >= 0.4, the `verifiers.v1`
stack), loaded by its id with verifiers' own loader, its tasks played by prime-rl's token-exact chat loop.

Split of the work:

- verifiers' own code: `vf.resolve_env_config` + `vf.load_environment` build the environment from its id and
  arguments (the taskset's config, exactly what `vf-eval`'s `--env.taskset.*` sets); the taskset gives the
  tasks (`TaskData.prompt`, `system_prompt`); the task's `Toolset`s give the tools (their `@vf.tool` methods);
  the task's rubric (`@vf.reward` functions, weighted) scores the conversation as a `vf.Trace`
  (`Task.score`, reward = `trace.reward`).
- ours: the conversation. Model calls go to our vLLM through `multiturn.py`, as for every multi-turn
  environment: each turn is sampled from token ids and its sampled ids and logprobs are what the trainer
  gets, so nothing is re-tokenized and `rollout/token_mismatch` checks every turn's prompt. This is the role
  verifiers' `null` harness plays (a chat loop with the task's tools), done token-exactly, and it runs in
  environment worker processes with per-rollout deadlines (`worker.py`) like any environment.

Left out, and refused at start with one line (so a run never trains on a silently different task):
environments with their own `Env.run` (multi-agent, simulated users), tasksets that ship their own harness
program, tasks that need a container or sandbox (`NEEDS_CONTAINER`, rewards taking a `runtime`), LLM
judges, `@vf.intercept` hooks and `@vf.stop` hooks over a model Request / Response (stops over the Trace
run after each environment reply). verifiers 0.4's own training path (`TrainClient`: a client-side `renderers` tokenizer and vLLM's
`/inference/v1/generate`, programs in runtimes behind an interception server) is not used: it needs the
tokenizer in the orchestrator and a harness program per rollout, and multiturn.py already gives exact tokens.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np
from pydantic import ValidationError

from prime_rl.orchestrator.envs.base import Messages, Task
from prime_rl.orchestrator.envs.tool_env import ToolEnvironment
from prime_rl.orchestrator.tools import ToolCall

SUPPORTED = ">=0.4,<0.5"
"""The verifiers releases this module is written against (the `verifiers.v1` API; 0.3 pins mcp<2, which
conflicts with vLLM's mcp>=2)."""
INSTALL_HINT = "pip install 'prime-rl-orchestrator[verifiers]'"


def import_verifiers() -> Any:
    """`verifiers.v1`, or one ImportError saying what to install."""
    try:
        installed = version("verifiers")
    except PackageNotFoundError:
        raise ImportError(
            f'env type = "verifiers" needs the verifiers package ({SUPPORTED}), which is not installed in '
            f"the orchestrator's Python; {INSTALL_HINT}"
        ) from None
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ImportError(
            f"verifiers {installed} is installed but `import verifiers.v1` failed ({e}); prime-rl supports "
            f"verifiers {SUPPORTED}: {INSTALL_HINT}"
        ) from e
    return vf


def run_sync(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run one of verifiers' coroutines (tools, stops, rubric) to completion from the synchronous environment
    API, also when this thread already runs an event loop (`workers = 0` builds the environment inside the
    orchestrator's loop, where `asyncio.run` refuses)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def module_of(env_id: str) -> str:
    """The module verifiers imports for `env_id` (hub ids `owner/name@version` install as `name`;
    dashes become underscores), as `verifiers.v1.utils.loaders` normalizes it."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def load_vf_env(vf: Any, env_id: str, args: dict[str, Any]) -> Any:
    """The verifiers `Env` for `env_id` with the taskset arguments `args`; one clear error otherwise."""
    try:
        config = vf.resolve_env_config({"taskset": {**args, "id": env_id}})
        return vf.load_environment(config)
    except ModuleNotFoundError as e:
        cause = e.__cause__ if isinstance(e.__cause__, ModuleNotFoundError) else e
        missing = (cause.name or "").split(".")[0]
        if missing and missing != module_of(env_id):
            raise ModuleNotFoundError(
                f"verifiers environment {env_id!r} is installed but importing it failed: {cause}; install what "
                "it depends on into the orchestrator's Python"
            ) from None
        raise ModuleNotFoundError(
            f"verifiers environment {env_id!r} is not installed (no module {module_of(env_id)!r}); install its "
            "package into the orchestrator's Python (e.g. pip install examples/verifiers_env for vf-arithmetic)"
        ) from None
    except ValidationError as e:  # bad arguments: one line naming each bad field
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ValueError(
            f"verifiers environment {env_id!r}: args {args!r} do not fit its taskset config ({problems})"
        ) from None
    except Exception as e:  # its own error, flattened: the orchestrator reports one line
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        raise ValueError(f"verifiers environment {env_id!r} with args {args!r} failed to load: {reason}") from e


def requires_runtime(fn: Callable[..., Any]) -> bool:
    """A scoring hook that takes a `runtime` without a default needs a sandbox (verifiers skips it without one)."""
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def check_playable(vf: Any, env: Any, env_id: str, sample: Any) -> None:
    """Refuse what prime-rl's chat loop would silently play differently from verifiers (see the module doc)."""
    if type(env) is not vf.SingleAgentEnv:
        raise ValueError(
            f"verifiers environment {env_id!r} is a {type(env).__name__}, which runs its own episodes "
            "(agents, users); prime-rl plays single-agent tasksets only (SingleAgentEnv)"
        )
    if vf.default_harness_id(env_id) != "bash":
        raise ValueError(
            f"verifiers environment {env_id!r} ships its own harness program, which prime-rl does not run "
            "(it plays the tasks with its own chat loop, like verifiers' null harness)"
        )
    if sample.NEEDS_CONTAINER:
        raise ValueError(f"verifiers environment {env_id!r}: its tasks need a container, which prime-rl does not run")
    if sample.config.judges:
        raise ValueError(f"verifiers environment {env_id!r} scores with LLM judges, which prime-rl does not support")
    sandboxed = [fn.__name__ for fn in sample.hooks("reward") if requires_runtime(fn)]
    if sandboxed:
        raise ValueError(
            f"verifiers environment {env_id!r}: rewards {sandboxed} need a runtime (sandbox), which prime-rl "
            "does not run; they would score nothing"
        )
    from verifiers.v1.session import hook_boundary
    from verifiers.v1.utils.decorators import discover_decorated

    intercepts = [fn.__name__ for fn in discover_decorated(sample, "intercept")]
    if intercepts:
        raise ValueError(
            f"verifiers environment {env_id!r}: its @vf.intercept hooks {intercepts} rewrite model requests or "
            "responses, which prime-rl's token-exact loop does not run"
        )
    model_stops = [fn.__name__ for fn in sample.hooks("stop") if hook_boundary(fn, allow_trace=True) is not vf.Trace]
    if model_stops:
        raise ValueError(
            f"verifiers environment {env_id!r}: @vf.stop hooks {model_stops} read a model Request or Response; "
            "prime-rl runs only stops over the Trace"
        )
    if sample.data.prompt is None:
        raise ValueError(f"verifiers environment {env_id!r}: its tasks have no prompt (the user opens); unsupported")


def as_tool(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """A `@vf.tool` method as a plain function named like verifiers names it for the model (`<server>_<tool>`,
    or bare when the toolset's TOOL_PREFIX is None); async tools run to completion here (environment calls are
    synchronous, in a worker process or a thread, never on the orchestrator's event loop)."""

    @functools.wraps(method)  # keeps the signature and docstring: the OpenAI schema comes from them
    def call(**kwargs: Any) -> Any:
        result = method(**kwargs)
        return run_sync(result) if inspect.isawaitable(result) else result

    call.__name__ = name
    return call


class VerifiersEnv(ToolEnvironment):
    """A verifiers taskset as a prime-rl multi-turn environment (one turn when it has no tools)."""

    def __init__(self, env_id: str, args: dict[str, Any] | None = None, max_turns: int = 4, max_tasks: int = 100_000):
        vf = import_verifiers()
        from verifiers.v1.utils.decorators import discover_decorated

        args = dict(args or {})
        env = load_vf_env(vf, env_id, args)
        taskset = env.taskset
        self.tasks = list(taskset if taskset.bounded else taskset.take(max_tasks))
        if not self.tasks:
            raise ValueError(f"verifiers environment {env_id!r} with args {args!r} has no tasks")
        check_playable(vf, env, env_id, self.tasks[0])
        toolsets = list(type(taskset).toolsets(taskset.config)) + list(
            type(self.tasks[0]).toolsets(taskset.config.task)
        )
        for toolset in toolsets:
            run_sync(toolset.setup())
        functions = [
            as_tool(f"{ts.server_name}_{tool_name}" if ts.server_name else tool_name, fn)
            for ts in toolsets
            for fn in discover_decorated(ts, "tool")
            for tool_name in [getattr(fn, "tool_name", None) or fn.__name__]
        ]
        super().__init__(functions, max_turns=max_turns)
        self.vf, self.name, self.args = vf, env_id, args

    def sample_tasks(self, n: int, rng: np.random.Generator) -> list[Task]:
        picks = rng.integers(len(self.tasks), size=n)
        return [
            {"idx": int(i), "data": self.tasks[i].data.model_dump(mode="json", exclude_defaults=True)} for i in picks
        ]

    def build_prompt(self, task: Task) -> Messages:
        from verifiers.v1.dialects.chat import message_to_wire

        data = self.tasks[task["idx"]].data
        messages: Messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            return messages + [{"role": "user", "content": data.prompt}]
        return messages + [message_to_wire(m) for m in data.prompt]

    def trace_of(self, task: Task, messages: Messages) -> Any:
        """The conversation as a `vf.Trace` (one branch of message nodes; assistant turns marked sampled). It
        carries no model-call records (token usage, finish reasons, timing): prime-rl keeps those itself."""
        from verifiers.v1.dialects.chat import parse_message
        from verifiers.v1.graph import MessageNode

        vf, vf_task = self.vf, self.tasks[task["idx"]]
        nodes = [
            MessageNode(parent=i - 1 if i else None, message=parse_message(m), sampled=m["role"] == "assistant")
            for i, m in enumerate(messages)
        ]
        return vf.Trace(
            task=vf.TraceTask(type=type(vf_task).__name__, data=vf_task.data, key=vf_task.key, hash=vf_task.hash),
            agent=vf.AgentInfo(config=vf.AgentConfig()),
            nodes=nodes,
        )

    def env_response(self, task: Task, messages: Messages, calls: list[ToolCall]) -> Messages | None:
        """The tool results, unless a `@vf.stop` over the trace fires: verifiers checks those before each model
        call, so a stop here ends the rollout before the turn that would read these results."""
        reply = super().env_response(task, messages, calls)
        if reply is None:
            return None
        return None if run_sync(self.stop_fired(task, messages + reply)) else reply

    async def stop_fired(self, task: Task, messages: Messages) -> bool:
        from verifiers.v1.session import call_hook

        trace = self.trace_of(task, messages)
        for stop in self.tasks[task["idx"]].hooks("stop"):
            fired = await call_hook(stop, {self.vf.Trace: trace})
            if not isinstance(fired, bool):
                raise TypeError(f"@vf.stop {stop.__name__} returned {fired!r}; a stop must return a bool")
            if fired:
                return True
        return False

    def score_rollout(self, task: Task, messages: Messages) -> float:
        """The task's rubric over the conversation, as verifiers scores a trace (weighted sum of its rewards)."""
        vf_task, trace = self.tasks[task["idx"]], self.trace_of(task, messages)
        run_sync(vf_task.score(trace))  # raises (a TaskError) when a reward function fails: scored as failed
        unscored = [name for name, r in trace.rewards.items() if r is None]
        if unscored:
            raise RuntimeError(f"rewards {unscored} of {self.name} returned no score")
        return trace.reward

    def score(self, task: Task, completion_text: str) -> float:
        return self.score_rollout(task, self.build_prompt(task) + [{"role": "assistant", "content": completion_text}])
