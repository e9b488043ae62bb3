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
root=$(cd "$(dirname "$0")/.." && pwd)
FERRITE=${FERRITE:-$root/target/release/ferrite}
PYTHON=${PYTHON:-$root/third_party/venv/bin/python}
BENCH_DIR=${BENCH_DIR:-$root/bench/out}
GEN_TOKENS=${GEN_TOKENS:-128}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
RUNS=${RUNS:-3}
ROUNDS=${ROUNDS:-3}
DTYPE=${DTYPE:-bf16}
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(tiny-4bit 0.6b-4bit)

mkdir -p "$BENCH_DIR"
ids=$BENCH_DIR/prompt-$PROMPT_TOKENS.json
# Ids below 400 exist in every preset's tokenizer; the formula only has to be shared.
"$PYTHON" -c "import json,sys; n=int(sys.argv[1]); print(json.dumps([(i*37+11)%400 for i in range(n)]))" "$PROMPT_TOKENS" > "$ids"

printf '%-14s %-12s %10s %10s %8s\n' case backend ferrite mlx-lm ratio
for c in "${cases[@]}"; do
  case $c in
    tiny-4bit) args=(--arch qwen3 --preset tiny --bits 4 --group-size 32) ;;
    0.6b-4bit) args=(--arch qwen3 --preset 0.6b --bits 4 --group-size 64) ;;
    8b-4bit) args=(--arch qwen3 --preset 8b --bits 4 --group-size 64) ;;
    30b-a3b-4bit) args=(--arch qwen3_moe --preset 30b-a3b --bits 4 --group-size 64) ;;
    next-tiny-4bit) args=(--arch qwen3_next --preset tiny --bits 4 --group-size 32 --mtp) ;;
    next-small-4bit) args=(--arch qwen3_next --preset small --bits 4 --group-size 32 --mtp) ;;
    next-35b-a3b-4bit) args=(--arch qwen3_next --preset 35b-a3b --bits 4 --group-size 64 --mtp) ;;
    *) echo "unknown case $c" >&2; exit 2 ;;
  esac
  dir=$BENCH_DIR/$c-$DTYPE
  [ -f "$dir/config.json" ] || "$FERRITE" dev make-checkpoint "${args[@]}" --dtype "$DTYPE" --out "$dir" >&2
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
