#!/usr/bin/env bash
# README command 1: set up, then answer a prompt with the default profile (the embedded SmolLM2-135M-Instruct,
# its GGUF's 4-bit weights, prompt-lookup speculation k=4: spec_edge/config.py's defaults, what every entry point
# runs when no profile is named), printing the text and a stats line naming the profile and weights form
# (profile=default weights=q4) with its acceptance, tokens/s and time to first token.
# The first run exports the ONNX graphs into ~/.cache/spec_edge/engines (~2-4 minutes on 2 cores; the node,
# `spec-edge serve` and the scripts load the same folder); later runs start in seconds.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$repo/scripts/setup.sh"
cd "$repo"
prompt=${1:-"Rewrite this status report for the operator, keeping every number: Robot arm 2 finished 14 picks in 3 minutes, battery at 76 percent, gripper temperature 41 degrees, next task: restock shelf B."}
.venv/bin/spec-edge generate --prompt "$prompt" --max-new-tokens 96
