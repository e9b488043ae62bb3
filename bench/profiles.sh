#!/usr/bin/env bash
# Sustained vs Turbo on the embedded default model, in one run: decode tok/s, time to first
# token at 128 / 2048 / 8192-token prompts, peak memory and CPU time per token, profiles
# alternating at each prompt size.
#
#   bench/profiles.sh            (FERRITE=path/to/ferrite, SIZES="128 2048 8192", RUNS=2, GEN_TOKENS=64)
set -euo pipefail
cd "$(dirname "$0")/.."
FERRITE=${FERRITE:-target/release/ferrite}
MODEL=${MODEL:-assets/models/ferrite-code-20m}
SIZES=${SIZES:-128 2048 8192}
RUNS=${RUNS:-2}
GEN_TOKENS=${GEN_TOKENS:-64}
OUT=${BENCH_DIR:-bench/out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
printf "%-10s %7s %10s %10s %12s %12s %14s\n" profile prompt "decode/s" "TTFT s" "prefill/s" "peak MB" "CPU ms/token"
for n in $SIZES; do
    ids="$OUT/profile-prompt-$n.json"
    # Held-out code, repeated to the length wanted.
    "$PY" -c "import json,sys; p=sum(json.load(open('bench/prompts/heldout-code.json')),[]); n=int(sys.argv[1]); json.dump((p*(n//len(p)+1))[:n], open(sys.argv[2],'w'))" "$n" "$ids"
    for profile in sustained turbo; do
        RUST_LOG=warn "$FERRITE" bench --model "$MODEL" --prompt-ids "$ids" --gen-tokens "$GEN_TOKENS" --runs "$RUNS" --profile "$profile" \
            | tee -a "$OUT/profiles.jsonl" \
            | "$PY" -c "import json,sys; r=json.load(sys.stdin); print('%-10s %7d %10.1f %10.3f %12.1f %12.1f %14.2f' % (r['profile'], r['prompt_tokens'], r['decode_tps'], r['ttft_s'], r['prompt_tps'], r['peak_memory_bytes']/1e6, r['cpu_seconds_per_token']*1e3))"
    done
done
