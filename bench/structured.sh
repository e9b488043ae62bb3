#!/usr/bin/env bash
# Structured output on the embedded model (bench/structured.py): 200 generated JSON schemas at
# temperature 0 and 0.7, draft depth 0 and 2 — answers that parse and validate, MTP acceptance
# under the grammar — and decode tok/s constrained vs free on the same prompts and lengths.
#   bench/structured.sh [--schemas N --speed M --depths 0,2 --temperatures 0,0.7]
set -euo pipefail
. "$(dirname "$0")/lib.sh"
"$PYTHON" "$root/bench/structured.py" --ferrite "$FERRITE" "$@" | tee "$BENCH_DIR/structured.jsonl"
