#!/usr/bin/env bash
# MTP acceptance of the embedded model on held-out code (bench/prompts/heldout-code.json:
# 96-token windows of 8 held-out files of the training split, see train/README.md), at
# temperature 0 and 0.7: acceptance by draft position, tokens per cycle and decode tok/s for
# D = 1..4 against plain decoding, in one run; with DRAFTER=DIR, a DFlash block drafter's
# block depths too (the same windows, the same run). 3 of the 8 windows turned out to be files
# the model trained on at another version of their crate (train/README.md, Corpus);
# PROMPTS=bench/prompts/heldout-code-unseen.json measures on the other 5 alone.
#
#   bench/acceptance.sh            (FERRITE=path/to/ferrite, GEN_TOKENS=128, DRAFTER=DIR, PROMPTS=FILE)
set -euo pipefail
cd "$(dirname "$0")/.."
FERRITE=${FERRITE:-target/release/ferrite}
MODEL=${MODEL:-assets/models/ferrite-code-20m}
GEN_TOKENS=${GEN_TOKENS:-128}
PROMPTS=${PROMPTS:-bench/prompts/heldout-code.json}
OUT=${BENCH_DIR:-bench/out}
mkdir -p "$OUT"
for temp in 0 0.7; do
    echo "== temperature $temp"
    RUST_LOG=warn "$FERRITE" bench --spec --model "$MODEL" --prompt-ids "$PROMPTS" \
        --gen-tokens "$GEN_TOKENS" --runs 1 --temp "$temp" ${DRAFTER:+--drafter "$DRAFTER"} | tee -a "$OUT/acceptance.jsonl" >/dev/null
done
