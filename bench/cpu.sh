#!/usr/bin/env bash
# Ferrite on a CPU, before and after an optimised BLAS and dequantized weights, against mlx-lm
# on the stock MLX wheel, in one run. For each case and prompt size, three engines alternate:
#   before  ferrite on the wheel's reference BLAS (preloaded from the venv's stock wheel) with
#           the checkpoint's quantized weights (FERRITE_CPU_WEIGHTS=quantized)
#   after   ferrite as it runs by default: OpenBLAS (scripts/setup.sh) and, within the memory
#           budget, weights dequantized to f32 at load (crates/engine/src/weight_form.rs)
#   mlx-lm  mlx-lm 0.32.2 on the stock wheel (third_party/venv)
# Each prints prefill tok/s (prompt / time to first token) and decode tok/s; then, for cases
# with an MTP head, the verify pass of D+1 positions and the draft step as multiples of a
# plain step, before and after (`ferrite bench --spec`), and the embedded model's time to
# first token for a 12K-token prompt.
#
#   bench/cpu.sh [CASE ...]     default: embedded next-tiny-4bit tiny-4bit 0.6b-4bit (the
#                               project-made cases of lib.sh, with f32 scales as a CPU wants)
# Environment: SIZES (default "128 2048 8192"; the made checkpoints run the first two, the
# 0.6B-shaped one the first only: its quantized prefill takes minutes), GEN_TOKENS (64), RUNS
# (timed runs after a warm-up, default 1), ROW_RUNS (processes per form in the one-row table,
# default 5), FERRITE, PYTHON, BENCH_DIR.
set -euo pipefail
GEN_TOKENS=${GEN_TOKENS:-64}
RUNS=${RUNS:-1}
ROW_RUNS=${ROW_RUNS:-5}
SIZES=${SIZES:-128 2048 8192}
. "$(dirname "$0")/lib.sh"
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(embedded next-tiny-4bit tiny-4bit 0.6b-4bit)
out=$BENCH_DIR/cpu.jsonl
stock=$($PYTHON -c 'import mlx, pathlib; print(pathlib.Path(mlx.__path__[0]).parent / "mlx_cpu.libs")')
reference_blas="$(ls "$stock"/libblas-*.so* | head -n1):$(ls "$stock"/liblapack-*.so* | head -n1)"

# The prompt ids of one size: held-out code repeated to length (every case's tokenizer has
# these ids: the embedded model's vocabulary is the largest, the presets' have >= 400).
ids_for() {
  local c=$1 n=$2 f=$BENCH_DIR/cpu-$1-$2.json
  "$PYTHON" - "$n" "$f" "$c" "$root" <<'PY'
import json, sys
n, path, case, root = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
if case == "embedded":
    ids = sum(json.load(open(f"{root}/bench/prompts/heldout-code.json")), [])
else:
    ids = [(i * 37 + 11) % 400 for i in range(997)]
json.dump((ids * (n // len(ids) + 1))[:n], open(path, "w"))
PY
  echo "$f"
}

model_for() {
  if [ "$1" = embedded ]; then echo "$root/assets/models/ferrite-code-20m"; else DTYPE=f32 checkpoint "$1"; fi
}

run() { # engine model ids -> one JSON line
  local engine=$1 model=$2 ids=$3
  case $engine in
    before) LD_PRELOAD=$reference_blas FERRITE_CPU_WEIGHTS=quantized RUST_LOG=warn \
              "$FERRITE" bench --model "$model" --prompt-ids "$ids" --gen-tokens "$GEN_TOKENS" --runs "$RUNS" ;;
    after) RUST_LOG=warn "$FERRITE" bench --model "$model" --prompt-ids "$ids" --gen-tokens "$GEN_TOKENS" --runs "$RUNS" ;;
    mlx-lm) "$PYTHON" "$root/bench/mlx_lm_decode.py" --model "$model" --prompt-ids "$ids" --gen-tokens "$GEN_TOKENS" --runs "$RUNS" ;;
  esac
}

echo "# $(date -u +%F) $(uname -m), $(nproc) cores; $(RUST_LOG=warn "$FERRITE" inspect "$root/assets/models/ferrite-code-20m" | grep '^BLAS')"
echo
echo "| case | prompt | before prefill | after prefill | mlx-lm prefill | before decode | after decode | mlx-lm decode | after / before (prefill, decode) | after / mlx-lm (prefill, decode) |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for c in "${cases[@]}"; do
  model=$(model_for "$c")
  sizes=($SIZES)
  case $c in
    embedded) ;;
    0.6b-*) sizes=("${sizes[@]:0:1}") ;;
    *) sizes=("${sizes[@]:0:2}") ;;
  esac
  for n in "${sizes[@]}"; do
    ids=$(ids_for "$c" "$n")
    lines=()
    for engine in before after mlx-lm; do
      line=$(run "$engine" "$model" "$ids")
      lines+=("$line")
      printf '{"case": "%s", "engine_run": "%s", "result": %s}\n' "$c" "$engine" "$line" >> "$out"
    done
    "$PYTHON" - "$c" "$n" "${lines[@]}" <<'PY'
import json, sys
c, n = sys.argv[1], sys.argv[2]
b, a, m = (json.loads(x) for x in sys.argv[3:6])
p = lambda r: r["prompt_tps"]
d = lambda r: r["decode_tps"]
print(f"| {c} | {n} | {p(b):.0f} | {p(a):.0f} | {p(m):.0f} | {d(b):.1f} | {d(a):.1f} | {d(m):.1f} "
      f"| {p(a)/p(b):.1f}x, {d(a)/d(b):.1f}x | {p(a)/p(m):.1f}x, {d(a)/d(m):.1f}x |")
PY
  done
done

echo
echo "Verify pass of D+1 positions and draft step, as multiples of a plain decode step (128-token prompt):"
echo
echo "| case | engine | plain step ms | draft step | verify D=1 | D=2 | D=3 | D=4 | acceptance at D=1 |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for c in "${cases[@]}"; do
  model=$(model_for "$c")
  # (grep -c reads all of inspect's output: -q would stop early and, under pipefail, fail it)
  RUST_LOG=warn "$FERRITE" inspect "$model" | grep -c 'speculative decoding available' >/dev/null || continue
  ids=$(ids_for "$c" 128)
  for engine in before after; do
    if [ $engine = before ]; then
      line=$(LD_PRELOAD=$reference_blas FERRITE_CPU_WEIGHTS=quantized RUST_LOG=warn "$FERRITE" bench --spec --model "$model" --prompt-ids "$ids" --gen-tokens "$GEN_TOKENS" --runs 1)
    else
      line=$(RUST_LOG=warn "$FERRITE" bench --spec --model "$model" --prompt-ids "$ids" --gen-tokens "$GEN_TOKENS" --runs 1)
    fi
    printf '{"case": "%s", "engine_run": "%s-spec", "result": %s}\n' "$c" "$engine" "$line" >> "$out"
    "$PYTHON" - "$c" "$engine" "$line" <<'PY'
import json, sys
c, e, r = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
v = {d["depth"]: d for d in r["depths"]}
acc = v[1]["acceptance"][0] if v[1]["acceptance"] else 0
print(f"| {c} | {e} | {r['plain_step_s']*1e3:.2f} | {r['draft_cost']:.2f}x | "
      + " | ".join(f"{v[d]['verify_cost']:.2f}x" for d in (1, 2, 3, 4)) + f" | {acc:.0%} |")
PY
  done
done

if [[ " ${cases[*]} " == *" embedded "* ]] && [ -f "$root/third_party/blas/libblas-sgemm-row.so" ]; then
  # One-row products through OpenBLAS's sgemm (its libblas preloaded ahead of the forwarder)
  # and through gemv (third_party/sgemm_row.c, the default), alternating in fresh processes.
  echo
  echo "Embedded model, one-row products on sgemm vs gemv (128-token prompt, $ROW_RUNS alternating processes each):"
  echo
  ids=$(ids_for embedded 128)
  openblas_blas=$(ldd "$root/third_party/blas/libblas-sgemm-row.so" | awk '/libopenblas/ { print $3 }')
  openblas_blas="$(dirname "$openblas_blas")/libblas.so.3"
  sgemm=() gemv=() spec_sgemm=() spec_gemv=()
  for _ in $(seq "$ROW_RUNS"); do
    for form in sgemm gemv; do
      preload=""; [ $form = sgemm ] && preload=$openblas_blas
      line=$(LD_PRELOAD=$preload RUST_LOG=warn "$FERRITE" bench --spec --model "$root/assets/models/ferrite-code-20m" \
        --prompt-ids "$ids" --gen-tokens "$GEN_TOKENS" --runs 1)
      printf '{"case": "embedded", "engine_run": "rows-%s", "result": %s}\n' "$form" "$line" >> "$out"
      if [ $form = sgemm ]; then sgemm+=("$line"); else gemv+=("$line"); fi
    done
  done
  "$PYTHON" - "${#sgemm[@]}" "${sgemm[@]}" "${gemv[@]}" <<'PY'
import json, sys
n = int(sys.argv[1])
runs = [json.loads(x) for x in sys.argv[2:]]
forms = {"sgemm": runs[:n], "gemv": runs[n:]}
print("| one-row products | plain step ms (min-max) | decode tok/s (min-max) | verify D=1 | D=2 | D=3 | D=4 (median) |")
print("| --- | --- | --- | --- | --- | --- | --- |")
med = lambda xs: sorted(xs)[len(xs) // 2]
for form, rs in forms.items():
    steps = [r["plain_step_s"] * 1e3 for r in rs]
    tps = [1e3 / s for s in steps]
    verify = [med([{d["depth"]: d for d in r["depths"]}[k]["verify_cost"] for r in rs]) for k in (1, 2, 3, 4)]
    print(f"| {form} | {min(steps):.2f}-{max(steps):.2f} | {min(tps):.0f}-{max(tps):.0f} | "
          + " | ".join(f"{v:.2f}x" for v in verify) + " |")
PY
fi

if [[ " ${cases[*]} " == *" embedded "* ]]; then
  echo
  ids=$(ids_for embedded 12288)
  line=$(RUST_LOG=warn "$FERRITE" bench --model "$root/assets/models/ferrite-code-20m" --prompt-ids "$ids" --gen-tokens 16 --runs 1)
  printf '{"case": "embedded", "engine_run": "after-12k", "result": %s}\n' "$line" >> "$out"
  "$PYTHON" - "$line" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
print(f"Embedded model, 12,288-token prompt (after): time to first token {r['ttft_s']:.1f} s "
      f"({r['prompt_tps']:.0f} tok/s), peak memory {r['peak_memory_bytes'] / 1e6:.0f} MB")
PY
fi
