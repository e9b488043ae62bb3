#!/usr/bin/env bash
# The vision tower's speed, Ferrite against mlx-vlm 0.7.10 on the same MLX: a Qwen3.5-shaped
# tower with random weights (made by mlx-vlm once, bf16), one picture of WIDTH x HEIGHT cut by
# Ferrite's processor (both run those patches), ROUNDS rounds alternating the engines, each a
# fresh process timing RUNS passes after a warm-up. One JSON line per process. On Linux,
# mlx-vlm runs twice a round: on the wheel's own BLAS (as a user gets it) and with the BLAS
# Ferrite multiplies with preloaded (engine against engine).
#   bench/vision.sh            (WIDTH=1024 HEIGHT=768 ROUNDS=3 RUNS=3)
set -euo pipefail
. "$(dirname "$0")/lib.sh"
WIDTH=${WIDTH:-1024} HEIGHT=${HEIGHT:-768} ROUNDS=${ROUNDS:-3} RUNS=${RUNS:-3}
tower=$BENCH_DIR/qwen3_5-vision-tower
[ -f "$tower/model.safetensors" ] || "$PYTHON" "$root/bench/mlx_vlm_vision_tower.py" --make "$tower"
out=$BENCH_DIR/vision.jsonl
: > "$out"
for round in $(seq "$ROUNDS"); do
  line=$("$FERRITE" dev vision-tower --model "$tower" --width "$WIDTH" --height "$HEIGHT" --runs "$RUNS" \
    --patches-out "$BENCH_DIR/vision-patches.f32")
  echo "$line" | tee -a "$out"
  grid=$(echo "$line" | "$PYTHON" -c "import json,sys; print(','.join(map(str, json.load(sys.stdin)['grid'])))")
  peer=("$PYTHON" "$root/bench/mlx_vlm_vision_tower.py" --time "$tower" --patches "$BENCH_DIR/vision-patches.f32" \
    --grid "$grid" --runs "$RUNS")
  "${peer[@]}" | tee -a "$out"
  blas=$root/third_party/blas/libblas-sgemm-row.so
  if [ "$(uname -s)" = Linux ] && [ -f "$blas" ]; then
    LD_PRELOAD=$blas "${peer[@]}" | sed 's/"mlx-vlm"/"mlx-vlm, Ferrite'"'"'s BLAS"/' | tee -a "$out"
  fi
done
"$PYTHON" - "$out" <<'PY'
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1])]
for engine in dict.fromkeys(r["engine"] for r in rows):
    s = [x for r in rows if r["engine"] == engine for x in r["seconds"]]
    print(f"{engine:8} median {statistics.median(s):.3f} s [{min(s):.3f}-{max(s):.3f}] over {len(s)} passes")
PY
