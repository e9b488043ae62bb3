#!/usr/bin/env bash
# Ferrite vs mlx-lm on the same project-made checkpoint, the same prompt ids and the same MLX
# build, in one run: decode tok/s, time to first token and peak memory at each prompt size,
# the ratios, and decode as a fraction of the memory-bandwidth bound. Prints a Markdown table
# (also appended to $BENCH_DIR/compare.md; raw JSON lines to $BENCH_DIR/compare.jsonl).
#
#   bench/compare.sh [CASE ...]     cases as in bench/lib.sh (default: tiny-4bit next-tiny-4bit,
#                                   small shapes for a CPU; on a GPU: 8b-4bit 32b-4bit next-35b-a3b-4bit)
# Environment: SIZES (prompt tokens, default "128 2048 8192"), GEN_TOKENS (256), RUNS (timed
# runs after one warm-up, median; default 1), PROFILE (ferrite's runtime profile, sustained:
# 2048-token prefill chunks like mlx-lm's default), BANDWIDTH_GBS (the device's memory
# bandwidth; found for NVIDIA H100/H200 via nvidia-smi), PROCESSES (fresh processes per engine
# and size, alternating; the table shows medians and the decode range; default 1), DTYPE,
# FERRITE, PYTHON, BENCH_DIR, PEERS (which mlx-lm runs beside Ferrite: `ops`, mlx-lm as it
# runs off a Mac, its recurrence as operations; `mac-like`, its Metal gated-delta kernel ported
# to CUDA and patched in (bench/mlx_lm_mac_like.py), as it runs on a Mac; `none`, Ferrite alone,
# to add processes to a cell measured before; default `ops`, on a CUDA GPU `ops mac-like`).
set -euo pipefail
GEN_TOKENS=${GEN_TOKENS:-256}
RUNS=${RUNS:-1}
PROCESSES=${PROCESSES:-1}
SIZES=${SIZES:-128 2048 8192}
PROFILE=${PROFILE:-sustained}
. "$(dirname "$0")/lib.sh"
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(tiny-4bit next-tiny-4bit)
if [ -z "${BANDWIDTH_GBS:-}" ] && command -v nvidia-smi >/dev/null; then
  case $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) in
    *H200*) BANDWIDTH_GBS=4800 ;;
    *H100*SXM* | *H100\ 80GB\ HBM3*) BANDWIDTH_GBS=3350 ;;
  esac
fi
export BANDWIDTH_GBS=${BANDWIDTH_GBS:-}
if [ -z "${PEERS:-}" ]; then
  PEERS=ops; command -v nvidia-smi >/dev/null && PEERS="ops mac-like"
fi

rows=$BENCH_DIR/compare-run.jsonl
: > "$rows"
for c in "${cases[@]}"; do
  dir=$(checkpoint "$c")
  for n in $SIZES; do
    PROMPT_TOKENS=$n
    ids=$(prompt_ids)
    # Ferrite first, then mlx-lm: each loads the model, warms up once, then times RUNS runs;
    # PROCESSES > 1 repeats the pair in fresh processes (a host-bound decode varies by process).
    for _ in $(seq "$PROCESSES"); do
      RUST_LOG=warn "$FERRITE" bench --model "$dir" --prompt-ids "$ids" --gen-tokens "$GEN_TOKENS" --runs "$RUNS" --profile "$PROFILE" \
        | "$PYTHON" -c 'import json,sys; r=json.load(sys.stdin); r["case"]=sys.argv[1]; print(json.dumps(r))' "$c" >> "$rows"
      for peer in $PEERS; do
        [ "$peer" = none ] && continue
        flag=; [ "$peer" = mac-like ] && flag=--mac-like
        "$PYTHON" "$root/bench/mlx_lm_decode.py" --model "$dir" --prompt-ids "$ids" --gen-tokens "$GEN_TOKENS" --runs "$RUNS" $flag \
          | "$PYTHON" -c 'import json,sys; r=json.load(sys.stdin); r["case"]=sys.argv[1]; print(json.dumps(r))' "$c" >> "$rows" \
          || echo "the $peer peer failed on $c at $n tokens: its cells stay empty" >&2
      done
    done
    tail -n 3 "$rows" >&2
  done
done
cat "$rows" >> "$BENCH_DIR/compare.jsonl"
"$PYTHON" "$root/bench/compare_table.py" --rows "$rows" --checkpoints "$BENCH_DIR" --dtype "$DTYPE" | tee -a "$BENCH_DIR/compare.md"
