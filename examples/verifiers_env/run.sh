#!/usr/bin/env bash
# RL on the verifiers example environment on CPU: install it, warm the tiny model up on tool calls (the
# tool_use example's model and SFT, skipped when already there), then RL on vf-arithmetic.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-.venv/bin}
"$BIN/pip" install -q ./examples/verifiers_env  # and verifiers (>=0.4,<0.5), its dependency
if [ ! -d outputs/tool_use/sft/weights/step_120 ]; then
  "$BIN/python" examples/tool_use/make_example.py
  "$BIN/sft" @ examples/tool_use/sft.toml
fi
"$BIN/rl" @ examples/verifiers_env/rl.toml "$@"
