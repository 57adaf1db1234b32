"""Inputs of the tool-use example: a tiny random Qwen3 whose chat template renders tools, and SFT warm-up
conversations in exactly the format RL samples.

    python examples/tool_use/make_example.py    # writes outputs/tool_use/{model,sft.jsonl}

Each conversation is built by the orchestrator's own `tool_arithmetic` environment: the question, the
model's `add` call (hermes format, `<tool_call>{...}</tool_call>`), the tool's answer as a tool message,
and the bare number. The system message is what the template writes for the environment's tools at RL
time ("Tools: add"), so SFT and RL prompts are the same tokens. The warm-up is short on purpose: the model
ends it with the format mostly right and the numbers often wrong; RL sharpens both.
"""

import argparse
import json
from pathlib import Path

import numpy as np

from prime_rl.common.testing import make_tiny_model
from prime_rl.orchestrator.envs.tool_arithmetic import ToolArithmeticEnv

TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools: ' + (tools | map(attribute='function') | map(attribute='name')"
    " | join(', ')) + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '<tool_call>' + (call['function'] | tojson) + '</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML plus tools: the tool names in a system message, calls as <tool_call>{json}</tool_call>, results
as `tool` messages (the hermes convention that orchestrator.model.tool_call_parser = "hermes" parses)."""


def conversation(env: ToolArithmeticEnv, task: dict) -> list[dict]:
    call = json.dumps({"name": task["op"], "arguments": {"a": task["a"], "b": task["b"]}})
    return [
        {"role": "system", "content": "Tools: " + ", ".join(t["function"]["name"] for t in env.tools)},
        *env.build_prompt(task),
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "tool", "content": str(task["answer"])},
        {"role": "assistant", "content": str(task["answer"])},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/tool_use"))
    parser.add_argument("--num-samples", type=int, default=2000)
    parser.add_argument("--max-value", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = make_tiny_model(args.out / "model", num_layers=2, hidden_size=128, seed=args.seed, dtype="float32")
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOL_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    env = ToolArithmeticEnv(max_value=args.max_value)
    rng = np.random.default_rng(args.seed + 1)  # other tasks than RL samples
    rows = [{"messages": conversation(env, task)} for task in env.sample_tasks(args.num_samples, rng)]
    data = args.out / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {model} (chat template with tools) and {data}")


if __name__ == "__main__":
    main()
