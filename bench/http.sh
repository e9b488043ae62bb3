#!/usr/bin/env bash
# Speed at the HTTP boundary: a streaming client's tok/s vs the engine's own decode tok/s for
# the same requests, through `ferrite serve` on loopback. Target: ratio >= 0.97.
#
#   bench/http.sh [CASE]     cases as in decode.sh (default tiny-4bit)
# Environment: as decode.sh, plus REQUESTS (5), MAX_TOKENS (256), DRAFT_DEPTH (0).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
c=${1:-tiny-4bit}
dir=$(checkpoint "$c")
port=$("$PYTHON" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
RUST_LOG=warn "$FERRITE" serve --model "$dir" --id "$c" --port "$port" --draft-depth "${DRAFT_DEPTH:-0}" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.1; done
result=$("$PYTHON" "$root/bench/http_client.py" --base "http://127.0.0.1:$port" --model "$c" \
  --requests "${REQUESTS:-5}" --max-tokens "${MAX_TOKENS:-256}")
echo "$result" >> "$BENCH_DIR/http.jsonl"
"$PYTHON" -c "import json,sys; r=json.loads(sys.argv[1]); print(f\"$c: client {r['client_tps']:.1f} tok/s, engine {r['engine_tps']:.1f} tok/s, ratio {r['ratio']:.3f}; end to end {r['end_to_end_ratio']:.3f} ({r['tokens']} tokens)\")" "$result"
