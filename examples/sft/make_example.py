"""Make the SFT example's inputs: a tiny random Qwen3 and a synthetic chat dataset (addition).

    python examples/sft/make_example.py            # writes outputs/sft-example/{model,data.jsonl}

The task: "add 12 7" -> "19". Loss is taken on the assistant answers only; a 2-layer model learns the
format in a few steps and the arithmetic over a few dozen, so the loss falls clearly within minutes on CPU.
"""

import argparse
import json
import random
from pathlib import Path

from prime_rl.common.testing import make_tiny_model


def make_conversations(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"add {a} {b}"},
                    {"role": "assistant", "content": str(a + b)},
                ]
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/sft-example"))
    parser.add_argument("--num-samples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    make_tiny_model(args.out / "model", num_layers=2, hidden_size=128, seed=args.seed, dtype="float32")
    data = args.out / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(args.num_samples, args.seed)))
    print(f"wrote {args.out / 'model'} and {data}")


if __name__ == "__main__":
    main()
