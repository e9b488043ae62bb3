#!/usr/bin/env bash
# The runtime draft-depth controller against a fixed depth and plain decoding (`ferrite dev
# depth`): one fixed answer, held-out code then prose, decoded the three ways in alternating
# rounds; decode tok/s, acceptance and the controller's decisions, one JSON line per setting.
#   bench/depth.sh [MODEL_DIR] [--depth 2 --rounds 3 --code-tokens 400]
# The code ids are in the embedded model's tokenizer; another model needs its own
# (--code-ids FILE).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
model=${1:-$root/assets/models/ferrite-code-20m}
shift || true
"$FERRITE" dev depth --model "$model" --code-ids "$root/bench/prompts/heldout-code.json" \
  --prose "$root/bench/prompts/prose.txt" "$@" | tee "$BENCH_DIR/depth.jsonl"
