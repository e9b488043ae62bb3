#!/usr/bin/env bash
# Decode speed of 1, 2, 4 and 8 sequences stepped together in the engine (`ferrite dev batch`:
# engine::batch, no HTTP) against one sequence alone, interleaved rounds on one model.
#   bench/batch.sh [MODEL_DIR] [--streams 1,2,4,8 --tokens 64 --rounds 3]
set -euo pipefail
. "$(dirname "$0")/lib.sh"
model=${1:-$root/assets/models/ferrite-code-20m}
shift || true
"$FERRITE" dev batch --model "$model" "$@" | tee "$BENCH_DIR/batch.jsonl"
