#!/usr/bin/env bash
# Decode speed, ferrite vs mlx-lm, on the same project-made checkpoints and prompt ids, in
# one run. Prints one line per case and the ratio ferrite / mlx-lm (> 1 = ferrite faster).
#
#   bench/decode.sh [CASE ...]       cases: tiny-4bit 0.6b-4bit 8b-4bit 30b-a3b-4bit, and the hybrids
#                                    next-tiny-4bit next-small-4bit next-35b-a3b-4bit (default: the first two)
# Environment: FERRITE (binary), PYTHON (with mlx-lm), BENCH_DIR (checkpoints), GEN_TOKENS,
# PROMPT_TOKENS, RUNS, ROUNDS (ferrite and mlx-lm alternate this many times; medians are
# compared, so drift on a shared machine hits both alike), DTYPE (of scales and unquantized weights: bf16, as mlx-community ships;
# f32 on a CPU, whose bf16 quantized matmul is ~8x slower).
set -euo pipefail
GEN_TOKENS=${GEN_TOKENS:-128}
RUNS=${RUNS:-3}
ROUNDS=${ROUNDS:-3}
. "$(dirname "$0")/lib.sh"
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(tiny-4bit 0.6b-4bit)
ids=$(prompt_ids)

printf '%-14s %-12s %10s %10s %8s\n' case backend ferrite mlx-lm ratio
for c in "${cases[@]}"; do
  dir=$(checkpoint "$c")
  fs=(); ps=()
  for _ in $(seq "$ROUNDS"); do
    fs+=("$(RUST_LOG=warn "$FERRITE" bench --model "$dir" --prompt-ids "$ids" --gen-tokens "$GEN_TOKENS" --runs "$RUNS")")
    ps+=("$("$PYTHON" "$root/bench/mlx_lm_decode.py" --model "$dir" --prompt-ids "$ids" --gen-tokens "$GEN_TOKENS" --runs "$RUNS")")
    printf '%s\n%s\n' "${fs[-1]}" "${ps[-1]}" >> "$BENCH_DIR/results.jsonl"
  done
  "$PYTHON" - "$c" "$(printf '%s\n' "${fs[@]}")" "$(printf '%s\n' "${ps[@]}")" <<'PY'
import json, statistics, sys
c = sys.argv[1]
f = [json.loads(l) for l in sys.argv[2].splitlines() if l.strip()]
p = [json.loads(l) for l in sys.argv[3].splitlines() if l.strip()]
med = lambda rows, k: statistics.median(r[k] for r in rows)
for label, k in ((c, "decode_tps"), ("  prefill", "prompt_tps")):
    a, b = med(f, k), med(p, k)
    print(f"{label:<14} {f[0]['backend'] if k == 'decode_tps' else '':<12} {a:10.1f} {b:10.1f} {a / b:8.3f}")
PY
done
