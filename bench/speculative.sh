#!/usr/bin/env bash
# MTP speculative decoding on a project-made hybrid checkpoint with an MTP head, in one run:
# plain decode tok/s, the cost of a verify pass of D+1 tokens and of a draft step relative to
# a plain step, acceptance and decode tok/s for D = 1..4, and the speed-up bound
# (1 + sum of acceptance) / (verify cost + D x draft cost). Random weights accept ~nothing,
# so the costs are the figures that matter; the "all ok" bound is the ceiling they allow.
#
#   bench/speculative.sh [CASE]      cases as in decode.sh: next-tiny-4bit (default), next-small-4bit, next-35b-a3b-4bit
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
FERRITE=${FERRITE:-$root/target/release/ferrite}
PYTHON=${PYTHON:-$root/third_party/venv/bin/python}
BENCH_DIR=${BENCH_DIR:-$root/bench/out}
GEN_TOKENS=${GEN_TOKENS:-64}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
DTYPE=${DTYPE:-bf16}
c=${1:-next-tiny-4bit}
case $c in
  next-tiny-4bit) args=(--arch qwen3_next --preset tiny --bits 4 --group-size 32) ;;
  next-small-4bit) args=(--arch qwen3_next --preset small --bits 4 --group-size 32) ;;
  next-35b-a3b-4bit) args=(--arch qwen3_next --preset 35b-a3b --bits 4 --group-size 64) ;;
  *) echo "unknown case $c" >&2; exit 2 ;;
esac
mkdir -p "$BENCH_DIR"
ids=$BENCH_DIR/prompt-$PROMPT_TOKENS.json
"$PYTHON" -c "import json,sys; n=int(sys.argv[1]); print(json.dumps([(i*37+11)%400 for i in range(n)]))" "$PROMPT_TOKENS" > "$ids"
dir=$BENCH_DIR/$c-$DTYPE
[ -f "$dir/config.json" ] || "$FERRITE" dev make-checkpoint "${args[@]}" --mtp --dtype "$DTYPE" --out "$dir" >&2
echo "case $c ($DTYPE)"
RUST_LOG=warn "$FERRITE" bench --spec --model "$dir" --prompt-ids "$ids" --gen-tokens "$GEN_TOKENS" --runs 1 | tee -a "$BENCH_DIR/speculative.jsonl" >/dev/null
