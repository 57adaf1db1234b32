"""Inputs of the arithmetic example: a tiny random Qwen3 and SFT warm-up data in the RL prompt format.

    python examples/arithmetic/make_example.py    # writes outputs/arithmetic/{model,sft.jsonl}

The SFT conversations are built by the orchestrator's own `arithmetic` environment (same prompt, and
the bare number as the answer, which is the only format its scorer rewards), so the warm-up teaches
exactly the format RL then samples and scores. The warm-up is
short on purpose: the model ends it right on some sums and unsure on others, and RL sharpens it.
"""

import argparse
import json
from pathlib import Path

import numpy as np

from prime_rl.common.testing import make_tiny_model
from prime_rl.orchestrator.envs.arithmetic import ArithmeticEnv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/arithmetic"))
    parser.add_argument("--num-samples", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    make_tiny_model(args.out / "model", num_layers=2, hidden_size=128, seed=args.seed, dtype="float32")
    env = ArithmeticEnv(num_terms=2, max_value=4)
    rng = np.random.default_rng(args.seed + 1)  # other tasks than RL samples (it seeds with 0)
    rows = [
        {"messages": [*env.build_prompt(task), {"role": "assistant", "content": str(task["answer"])}]}
        for task in env.sample_tasks(args.num_samples, rng)
    ]
    data = args.out / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {args.out / 'model'} and {data}")


if __name__ == "__main__":
    main()
