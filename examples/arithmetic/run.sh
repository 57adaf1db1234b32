#!/usr/bin/env bash
# The whole example on CPU: make a tiny model, SFT warm-up, then RL. ~5-8 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-.venv/bin}
"$BIN/python" examples/arithmetic/make_example.py
"$BIN/sft" @ examples/arithmetic/sft.toml
"$BIN/rl" @ examples/arithmetic/rl.toml "$@"
