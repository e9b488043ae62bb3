#!/usr/bin/env bash
# 1, 2, 4 and 8 concurrent streaming clients (distinct prompts) against `ferrite serve` and
# `mlx_lm.server` (0.32.2) on the same model, both up at once and their runs alternating
# (bench/clients.py): total and per-stream decode tok/s and time to first token.
#   bench/clients.sh [MODEL_DIR] [--clients 1,2,4,8 --max-tokens 64 --rounds 1]
# PROFILE (default sustained: at most 4 requests decode together; turbo: 8), DRAFT (0).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
model=${1:-$root/assets/models/ferrite-code-20m}
shift || true
free_port() { "$PYTHON" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
# Up when PATH answers (mlx_lm.server's /v1/models fails where no Hugging Face cache folder
# exists); gives up at once when the server has died or says its model did not load.
wait_up() {
  for _ in $(seq 3000); do
    curl -sf "http://127.0.0.1:$1$2" >/dev/null && return
    if ! kill -0 "$3" 2>/dev/null || grep -qs "thread died" "$4"; then
      echo "the server on :$1 did not come up:" >&2; tail -5 "$4" >&2; return 1
    fi
    sleep 0.2
  done
  echo "no answer on :$1$2" >&2; return 1
}
out=$BENCH_DIR/clients.jsonl
: > "$out"
ours=$(free_port)
FERRITE_PROMPT_CACHE_MB=0 FERRITE_PROMPT_DISK_GB=0 RUST_LOG=warn "$FERRITE" serve --model "$model" --port "$ours" \
  --draft-depth "${DRAFT:-0}" --profile "${PROFILE:-sustained}" &
ferrite=$!
peer=$(free_port)
"$PYTHON" "$root/bench/mlx_lm_server.py" --model "$model" --port "$peer" 2>"$BENCH_DIR/mlx_lm.server.log" &
mlx=$!
trap 'kill $ferrite $mlx 2>/dev/null; wait 2>/dev/null || true' EXIT
wait_up "$ours" /v1/models $ferrite /dev/null
wait_up "$peer" /health $mlx "$BENCH_DIR/mlx_lm.server.log"
"$PYTHON" "$root/bench/clients.py" --server "ferrite=http://127.0.0.1:$ours=ferrite" \
  --server "mlx_lm.server=http://127.0.0.1:$peer=$model" "$@" | tee -a "$out"
