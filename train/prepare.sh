#!/usr/bin/env bash
# The CPU half of reproducing the embedded model (see train/README.md): the corpus, the
# tokenizer trained on it, and the token ids train.py reads, all under train/data.
set -euo pipefail
cd "$(dirname "$0")/.."
FERRITE=${FERRITE:-target/release/ferrite}
[ -x "$FERRITE" ] || cargo build --release -p ferrite-cli
cargo fetch --locked >/dev/null   # the Rust half of the corpus is Cargo.lock's crates
python3 train/corpus.py --out train/data --manifest train/data/manifest.json
"$FERRITE" dev train-tokenizer --docs train/data/train.jsonl --vocab 8192 --out train/data/tokenizer
"$FERRITE" dev tokenize --tokenizer train/data/tokenizer --docs train/data/train.jsonl --out train/data/train.bin
"$FERRITE" dev tokenize --tokenizer train/data/tokenizer --docs train/data/heldout.jsonl --out train/data/heldout.bin
cmp -s train/data/manifest.json train/corpus-manifest.json && echo "corpus identical to the shipped model's" \
    || echo "note: the corpus differs from train/corpus-manifest.json (other Python or crate sources)"
