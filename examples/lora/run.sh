#!/usr/bin/env bash
# LoRA end to end on CPU: make a tiny model, LoRA SFT warm-up (adapters + embeddings / LM head in full,
# merged export), then LoRA RL on the merged weights (adapters only, published to vLLM by name each step).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-.venv/bin}
"$BIN/python" examples/arithmetic/make_example.py --out outputs/lora
"$BIN/sft" @ examples/lora/sft.toml
"$BIN/rl" @ examples/lora/rl.toml "$@"
