#!/usr/bin/env bash
# 1, 2, 4 and 8 concurrent streaming clients (distinct prompts) against `ferrite serve` and
# `mlx_lm.server` (0.32.0) on the same model, one after the other in one run: total and
# per-stream decode tok/s and time to first token (bench/clients.py).
#   bench/clients.sh [MODEL_DIR] [--clients 1,2,4,8 --max-tokens 64]
set -euo pipefail
. "$(dirname "$0")/lib.sh"
model=${1:-$root/assets/models/ferrite-code-20m}
shift || true
free_port() { "$PYTHON" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
wait_up() { for _ in $(seq 1200); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return; sleep 0.1; done; return 1; }
out=$BENCH_DIR/clients.jsonl
: > "$out"
port=$(free_port)
FERRITE_PROMPT_CACHE_MB=0 FERRITE_PROMPT_DISK_GB=0 RUST_LOG=warn "$FERRITE" serve --model "$model" --port "$port" --draft-depth 0 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
wait_up "$port"
"$PYTHON" "$root/bench/clients.py" --base "http://127.0.0.1:$port" --model ferrite --label ferrite "$@" | tee -a "$out"
kill $server; wait $server 2>/dev/null || true
port=$(free_port)
"$PYTHON" -m mlx_lm.server --model "$model" --port "$port" 2>/dev/null &
server=$!
wait_up "$port"
"$PYTHON" "$root/bench/clients.py" --base "http://127.0.0.1:$port" --model "$model" --label mlx_lm.server "$@" | tee -a "$out"
