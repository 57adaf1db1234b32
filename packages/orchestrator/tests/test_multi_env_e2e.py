"""The orchestrator loop with several environments: a multi-turn tool environment and a faulty one, both in
worker processes, mixed by weight, against a fake vLLM that speaks the token-level API (/tokenize,
/detokenize, /v1/completions with token-id prompts) and chat.

The fake model is scripted: on a tool_arithmetic question, even choices write a correct `add` call and odd
ones a malformed call; after a tool result it answers with the result (after an error: "0"). So every
rollout has two turns, half score 1 (call + answer) and half 0 (malformed call, wrong answer), and no
token may differ between what was "sampled" and what is trained on. The faulty environment's scorer hangs
on the chat completion "HANG": those rollouts time out (counted) and the run goes on.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from prime_rl.common.config.orchestrator import OrchestratorConfig
from prime_rl.common.monitor import FileMonitor, read_metrics
from prime_rl.common.net import free_port
from prime_rl.common.rundir import RunDir
from prime_rl.common.wire import micro_batch_arrays
from prime_rl.orchestrator.client import InferenceClient
from prime_rl.orchestrator.entrypoint import build_env_handles
from prime_rl.orchestrator.orchestrator import Orchestrator

HERE = Path(__file__).parent
SPECIAL = {"<|im_start|>": 1, "<|im_end|>": 2}
EOS, OFFSET = 2, 3


def encode(text: str) -> list[int]:
    ids: list[int] = []
    for part in re.split(r"(<\|im_start\|>|<\|im_end\|>)", text):
        ids += [SPECIAL[part]] if part in SPECIAL else [b + OFFSET for b in part.encode()]
    return ids


def decode(ids: list[int]) -> str:
    names = {v: k for k, v in SPECIAL.items()}
    out, buf = [], bytearray()
    for t in ids:
        if t in names:
            out.append(buf.decode(errors="replace") + names[t])
            buf = bytearray()
        else:
            buf.append(t - OFFSET)
    return "".join(out) + buf.decode(errors="replace")


def render(messages: list[dict], tools, add_generation_prompt: bool, continue_final_message: bool) -> str:
    text = f"<|im_start|>system\nTools: {json.dumps(tools)}<|im_end|>\n" if tools else ""
    for m in messages:
        body = m.get("content") or ""
        for call in m.get("tool_calls") or []:
            body += f"<tool_call>{json.dumps(call['function'])}</tool_call>"
        text += f"<|im_start|>{m['role']}\n{body}<|im_end|>\n"
    if continue_final_message:
        text = text.removesuffix("<|im_end|>\n")
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def scripted_reply(prompt: str, i: int) -> str:
    role, content = re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", prompt, re.DOTALL)[-1]
    if role == "tool":
        return content if not content.startswith("error:") else "0"
    a, b = map(int, re.search(r"What is (\d+) \+ (\d+)\?", content).groups())
    if i % 2:
        return "<tool_call>{oops</tool_call>"
    return f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


class FakeTokenServer:
    def __init__(self) -> None:
        self.paths: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.paths.append(self.path)
                if self.path == "/tokenize":
                    text = render(body["messages"], body.get("tools"), body["add_generation_prompt"],
                                  body["continue_final_message"])  # fmt: skip
                    return self._reply({"tokens": encode(text), "count": 0, "max_model_len": 4096})
                if self.path == "/detokenize":
                    return self._reply({"prompt": decode(body["tokens"])})
                if self.path == "/v1/completions":
                    return self._reply(server.complete(body))
                if self.path == "/v1/chat/completions":
                    return self._reply(server.chat(body))
                self.send_response(404)
                self.end_headers()

            def _reply(self, payload: dict):
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            request_queue_size = 256
            daemon_threads = True

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def complete(self, body: dict) -> dict:
        prompt = body["prompt"]
        seed = body.get("seed") or 0
        text = scripted_reply(decode(prompt), seed)
        ids = encode(text)[: body["max_tokens"] - 1] + [EOS]
        choice = {"index": 0, "text": text, "token_ids": ids, "prompt_token_ids": prompt, "finish_reason": "stop",
                  "logprobs": {"token_logprobs": [-0.01 * (j + 1) for j in range(len(ids))]}}  # fmt: skip
        return {"id": "cmpl", "object": "text_completion", "choices": [choice]}

    def chat(self, body: dict) -> dict:
        source = body["messages"][-1]["content"].splitlines()[-1]
        prompt_ids = encode(render(body["messages"], None, True, False))
        choices = []
        for i in range(body["n"]):
            text = "HANG" if i == 0 else source[::-1]
            ids = encode(text) + [EOS]
            choices.append({"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": "stop",
                            "token_ids": ids, "logprobs": {"content": [{"logprob": -0.1} for _ in ids]}})  # fmt: skip
        return {"id": "chat", "choices": choices, "prompt_token_ids": prompt_ids}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class NoControl:
    async def pause(self, mode): ...
    async def load_weights(self, path, version): ...
    async def resume(self): ...
    def close(self): ...


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    s = FakeTokenServer()
    yield s
    s.close()


def run(tmp_path: Path, base_url: str, steps: int, envs: list[dict], **extra) -> tuple[list[dict], list]:
    config = OrchestratorConfig.model_validate(
        dict(
            output_dir=tmp_path,
            run_name="run",
            model={"name": "tiny", "client": {"base_url": base_url}},
            env=envs,
            batch_size=8,
            group_size=4,
            seq_len=512,
            sampling={"max_tokens": 64, "seed": 0},
            max_steps=steps,
            max_off_policy_steps=steps,
            trainer={"weights_port": free_port()},
            seed=1,
            advantage={"filter_zero_advantage": False},
            **extra,
        )  # fmt: skip
    )
    sent: list = []

    async def go() -> None:
        client = InferenceClient(base_url, "tiny", max_retries=0)
        monitor = FileMonitor(RunDir(tmp_path, "run"))
        try:
            orchestrator = Orchestrator(
                config, build_env_handles(config.env), client, NoControl(), sent.extend, monitor
            )
            await asyncio.wait_for(orchestrator.run(), timeout=60)
        finally:
            await client.aclose()
            monitor.close()

    asyncio.run(go())
    return read_metrics(RunDir(tmp_path, "run").metrics_path), sent


def test_tool_env_and_faulty_env_mixed_in_workers(tmp_path, server):
    envs = [
        {"type": "tool_arithmetic", "max_value": 20, "weight": 3.0},
        {"type": "python", "name": "faulty", "entrypoint": "faulty_envs:FaultyEnv", "weight": 1.0, "timeout": 1.0},
    ]
    metrics, sent = run(tmp_path, server.base_url, steps=4, envs=envs)
    assert len(metrics) == 4 and not any(k.startswith("eval/") for m in metrics for k in m)
    tool_groups = sum(m.get("env/tool_arithmetic/groups", 0) for m in metrics)
    faulty_groups = sum(m.get("env/faulty/groups", 0) for m in metrics)
    assert tool_groups + faulty_groups == 8 and tool_groups > faulty_groups > 0  # weights 3 : 1
    for m in metrics:
        assert m["rollout/token_mismatch"] == 0
        if m.get("env/tool_arithmetic/groups"):
            # even choices call add and answer (1.0), odd ones write a malformed call (0.0)
            assert m["env/tool_arithmetic/reward_mean"] == pytest.approx(0.5)
            assert m["tool/malformed_calls"] * 2 == m["tool/calls"] > 0
            assert m["rollout/turns"] == 2
    # every faulty group has a HANG completion: its rollout timed out and was counted; the run went on
    assert sum(m.get("env/faulty/timeouts", 0) for m in metrics) >= faulty_groups
    assert sum(m.get("env/faulty/rollouts_failed", 0) for m in metrics) >= faulty_groups
    assert "/tokenize" in server.paths and "/v1/completions" in server.paths
    # loss only on sampled tokens: the tool message and the template's tokens between turns are not trained
    for batch, arrays in sent:
        for mb in batch.micro_batches:
            a = micro_batch_arrays(mb, arrays)
            mask = a["loss_mask"].astype(bool)
            assert (a["inference_logprobs"][mask] < 0).all() and not a["inference_logprobs"][~mask].any()
            ids = a["input_ids"][mask]
            assert not np.isin(ids, [1]).any()  # <|im_start|> is never sampled: never in the loss


def test_eval_entrypoint_pass_at_k_and_samples(tmp_path, server):
    from prime_rl.orchestrator.eval_entrypoint import main

    toml = tmp_path / "eval.toml"
    toml.write_text(
        f"""
output_dir = "{tmp_path}"
run_name = "ev"
step = 7
num_examples = 5
rollouts_per_example = 4
[model]
name = "tiny"
[model.client]
base_url = "{server.base_url}"
max_retries = 0
[sampling]
seed = 0
[[env]]
type = "tool_arithmetic"
max_value = 20
"""
    )
    main(["@", str(toml)])
    (row,) = read_metrics(RunDir(tmp_path, "ev").metrics_path)
    assert row["step"] == 7
    # seeds alternate within a task: 2 of 4 rollouts call the tool and answer (reward 1), 2 write a malformed call
    assert row["eval/tool_arithmetic/reward_mean"] == pytest.approx(0.5)
    assert row["eval/tool_arithmetic/pass@1"] == pytest.approx(0.5)
    assert row["eval/tool_arithmetic/pass@2"] == pytest.approx(1 - 1 / 6)
    assert row["eval/tool_arithmetic/pass@4"] == 1.0
    samples = (tmp_path / "ev/evals/step_7/tool_arithmetic/samples.jsonl").read_text().splitlines()
    assert len(samples) == 5 and json.loads(samples[0])["rewards"].count(1.0) == 2


def test_eval_bad_environment_is_one_line(tmp_path, server, capsys):
    from prime_rl.orchestrator.eval_entrypoint import main

    args = ["--output-dir", str(tmp_path), "--model.client.base-url", server.base_url]
    toml = tmp_path / "eval.toml"
    toml.write_text('[[env]]\ntype = "python"\nentrypoint = "not_installed_envs:Env"\n')
    with pytest.raises(SystemExit) as e:
        main(["@", str(toml), *args])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "cannot import 'not_installed_envs'" in err[-1] and "eval failed" in err[-1]
    toml.write_text('[[env]]\ntype = "no_such_env"\n')
    with pytest.raises(SystemExit) as e:
        main(["@", str(toml), *args])
    assert e.value.code == 2  # a config error, named before anything starts


def test_online_evals_every_n_steps(tmp_path, server):
    envs = [{"type": "tool_arithmetic", "max_value": 20}]
    evaluation = {"interval": 2, "num_examples": 3, "rollouts_per_example": 2, "seed": 99}
    metrics, _ = run(tmp_path, server.base_url, steps=4, envs=envs, eval=evaluation)
    evals = [m for m in metrics if "eval/tool_arithmetic/reward_mean" in m]
    train = [m for m in metrics if "reward/mean" in m]
    assert [m["step"] for m in evals] == [0, 2, 4] and len(train) == 4
    for m in evals:  # seeds alternate: one of the two rollouts per task passes
        assert m["eval/tool_arithmetic/pass@1"] == pytest.approx(0.5) and m["eval/tool_arithmetic/pass@2"] == 1.0
        assert m["eval/tool_arithmetic/num_examples"] == 3
    assert (tmp_path / "run/evals/step_4/tool_arithmetic/samples.jsonl").is_file()
