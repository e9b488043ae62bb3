#!/usr/bin/env bash
# MTP speculative decoding on a project-made hybrid checkpoint with an MTP head, in one run:
# plain decode tok/s, the cost of a verify pass of D+1 tokens and of a draft step relative to
# a plain step, acceptance and decode tok/s for D = 1..4, and the speed-up bound
# (1 + sum of acceptance) / (verify cost + D x draft cost). Random weights accept ~nothing,
# so the costs are the figures that matter; the "all ok" bound is the ceiling they allow.
#
#   bench/speculative.sh [CASE]      cases as in decode.sh: next-tiny-4bit (default), next-small-4bit, next-35b-a3b-4bit
set -euo pipefail
GEN_TOKENS=${GEN_TOKENS:-64}
. "$(dirname "$0")/lib.sh"
c=${1:-next-tiny-4bit}
ids=$(prompt_ids)
dir=$(checkpoint "$c")
echo "case $c ($DTYPE)"
RUST_LOG=warn "$FERRITE" bench --spec --model "$dir" --prompt-ids "$ids" --gen-tokens "$GEN_TOKENS" --runs 1 | tee -a "$BENCH_DIR/speculative.jsonl" >/dev/null
