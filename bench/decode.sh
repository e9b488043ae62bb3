#!/usr/bin/env bash
# Decode speed, ferrite vs mlx-lm, on the same project-made checkpoints and prompt ids, in
# one run. Prints one line per case and the ratio ferrite / mlx-lm (> 1 = ferrite faster).
#
#   bench/decode.sh [CASE ...]       cases: tiny-4bit 0.6b-4bit 8b-4bit 30b-a3b-4bit (default: the first two)
# Environment: FERRITE (binary), PYTHON (with mlx-lm), BENCH_DIR (checkpoints), GEN_TOKENS,
# PROMPT_TOKENS, RUNS, DTYPE (of scales and unquantized weights: bf16, as mlx-community ships;
# f32 on a CPU, whose bf16 quantized matmul is ~8x slower).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
FERRITE=${FERRITE:-$root/target/release/ferrite}
PYTHON=${PYTHON:-$root/third_party/venv/bin/python}
BENCH_DIR=${BENCH_DIR:-$root/bench/out}
GEN_TOKENS=${GEN_TOKENS:-128}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
RUNS=${RUNS:-3}
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
    *) echo "unknown case $c" >&2; exit 2 ;;
  esac
  dir=$BENCH_DIR/$c-$DTYPE
  [ -f "$dir/config.json" ] || "$FERRITE" dev make-checkpoint "${args[@]}" --dtype "$DTYPE" --out "$dir" >&2
  f=$(RUST_LOG=warn "$FERRITE" bench --model "$dir" --prompt-ids "$ids" --gen-tokens "$GEN_TOKENS" --runs "$RUNS")
  p=$("$PYTHON" "$root/bench/mlx_lm_decode.py" --model "$dir" --prompt-ids "$ids" --gen-tokens "$GEN_TOKENS" --runs "$RUNS")
  echo "$f" >> "$BENCH_DIR/results.jsonl"; echo "$p" >> "$BENCH_DIR/results.jsonl"
  "$PYTHON" - "$c" "$f" "$p" <<'PY'
import json, sys
c, f, p = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
print(f"{c:<14} {f['backend']:<12} {f['decode_tps']:10.1f} {p['decode_tps']:10.1f} {f['decode_tps'] / p['decode_tps']:8.3f}")
print(f"{'  prefill':<14} {'':<12} {f['prompt_tps']:10.1f} {p['prompt_tps']:10.1f} {f['prompt_tps'] / p['prompt_tps']:8.3f}")
PY
done
