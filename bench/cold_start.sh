#!/usr/bin/env bash
# Cold starts together: for each process count (PROCESSES, default "4 8") and ROUNDS rounds
# (default 3), that many `ferrite generate` processes start at once on an empty temporary
# folder (so an empty MLX CPU kernel cache), and the ones that fail are counted. With
# PEER=mlx the same is done with MLX's own Python package (the reference venv, the same MLX
# version): processes that compile the same kernels into MLX's shared folder, which is what
# Ferrite's processes did before each got a folder of its own (engine::kernel_cache).
#
#   bench/cold_start.sh                      Ferrite (FERRITE=…/ferrite, MODEL=default)
#   PEER=mlx bench/cold_start.sh             MLX's own compile cache, for comparison
set -euo pipefail
. "$(dirname "$0")/lib.sh"
MODEL=${MODEL:-default}
PROCESSES=${PROCESSES:-4 8}
ROUNDS=${ROUNDS:-3}
PEER=${PEER:-ferrite}
# Several fused kernels, each compiled on first use, as a model's forward pass compiles them.
mlx_job='
import mlx.core as mx
mx.set_default_device(mx.cpu)
for n in range(12):
    f = mx.compile(lambda x, y, n=n: mx.sigmoid(x * (n + 1)) * y + mx.exp(-x) - n)
    x = mx.ones((64 + n,))
    mx.eval(f(x, x))
'
one() {
  case $PEER in
    ferrite) "$FERRITE" generate --model "$MODEL" --prompt hello --max-tokens 3 ;;
    mlx) "$PYTHON" -c "$mlx_job" ;;
    *) echo "PEER is ferrite or mlx" >&2; exit 2 ;;
  esac
}
echo "| peer | processes | round | failed | seconds | first failure |"
echo "|---|---|---|---|---|---|"
for n in $PROCESSES; do
  for round in $(seq 1 "$ROUNDS"); do
    tmp=$(mktemp -d)
    started=$(date +%s.%N)
    pids=()
    for i in $(seq 1 "$n"); do
      (TMPDIR=$tmp one > "$tmp.out.$i" 2>&1) &
      pids+=($!)
    done
    failed=0
    for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
    seconds=$(awk "BEGIN { print $(date +%s.%N) - $started }")
    # MLX's message names the kernel's file; its cause is what tells the failures apart.
    error=$(grep -ho "Could not load C++ shared library.*: \(file too short\|.*\)$\|Failed to compile" "$tmp".out.* 2>/dev/null |
      sed 's/.*: //' | head -1 || true)
    printf "| %s | %d | %d | %d | %.1f | %s |\n" "$PEER" "$n" "$round" "$failed" "$seconds" "${error:-}"
    rm -rf "$tmp" "$tmp".out.*
  done
done
