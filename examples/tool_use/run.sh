#!/usr/bin/env bash
# The whole tool-use example on CPU: make a tiny model with a tool chat template, SFT warm-up, then RL.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-.venv/bin}
"$BIN/python" examples/tool_use/make_example.py
"$BIN/sft" @ examples/tool_use/sft.toml
"$BIN/rl" @ examples/tool_use/rl.toml "$@"
