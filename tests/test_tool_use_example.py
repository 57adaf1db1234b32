"""examples/tool_use: its SFT conversations are exactly what RL samples and scores.

The warm-up only helps RL if the prompts it trains on are the tokens RL prompts with (the template
renders the environment's tools as the system message the SFT data carries) and its assistant turns are
calls the orchestrator parses and answers the environment scores 1.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from prime_rl.orchestrator.envs.tool_arithmetic import ToolArithmeticEnv
from prime_rl.orchestrator.tools import execute_tool_call, parse_tool_calls

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sft_data_matches_rl_prompts_and_scores_one(tmp_path, monkeypatch):
    example = _load("tool_use_make_example", ROOT / "examples/tool_use/make_example.py")
    monkeypatch.setattr("sys.argv", ["make_example.py", "--out", str(tmp_path), "--num-samples", "20"])
    example.main()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    env = ToolArithmeticEnv(max_value=9)
    rows = [json.loads(line)["messages"] for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert len(rows) == 20
    for messages in rows:
        system, user, call, tool, answer = messages
        # the RL prompt (environment messages + the env's tools, rendered by the template) == the SFT prefix
        rl_prompt = tokenizer.apply_chat_template([user], tools=env.tools, add_generation_prompt=True)
        sft_prefix = tokenizer.apply_chat_template([system, user], add_generation_prompt=True)
        assert rl_prompt == sft_prefix
        task = {"op": "add", "a": None, "b": None, "answer": int(answer["content"])}
        content, calls = parse_tool_calls(call["content"])
        assert content == "" and len(calls) == 1 and calls[0].error is None
        task["a"], task["b"] = calls[0].arguments["a"], calls[0].arguments["b"]
        assert execute_tool_call(calls[0], env.functions) == (tool["content"], None)
        conversation = [user, {"role": "assistant", "content": "", "tool_calls": [calls[0].to_message()]},
                        {"role": "tool", "content": tool["content"]}, answer]  # fmt: skip
        assert env.score_rollout(task, conversation) == 1.0
    # the tasks are the environment's own draws (other seed than RL's), not a fixed list
    assert len({json.dumps(r[1]) for r in rows}) > 10
    assert np.all([int(r[4]["content"]) <= 18 for r in rows])
