#!/usr/bin/env bash
# A model split across two ranks on this machine (`--hosts`, ring backend over loopback)
# against the whole model in one process: decode tok/s, TTFT and the memory each process holds,
# alternating, ROUNDS fresh processes each (`ferrite generate`). One JSON line per run.
#   bench/distributed.sh [CASE...]     (cases from lib.sh; default 0.6b-4bit next-small-4bit)
# On a GPU host with two GPUs: BACKEND=nccl.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
ROUNDS=${ROUNDS:-3}
TOKENS=${TOKENS:-128}
BACKEND=${BACKEND:-ring}
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(0.6b-4bit next-small-4bit)
hosts=$BENCH_DIR/hosts-2.json
echo '[{"ips": ["127.0.0.1"]}, {"ips": ["127.0.0.1"]}]' > "$hosts"
prompt=$(printf 'def merge(a, b):\n    out = []\n%.0s' $(seq 1 40))
out=$BENCH_DIR/distributed.jsonl
: > "$out"
for case in "${cases[@]}"; do
  model=$(checkpoint "$case")
  for round in $(seq 1 "$ROUNDS"); do
    for ranks in 1 2; do
      extra=()
      [ "$ranks" = 2 ] && extra=(--hosts "$hosts" --backend "$BACKEND")
      log=$(RUST_LOG=warn "$FERRITE" generate -m "$model" -p "$prompt" --max-tokens "$TOKENS" \
        --draft-depth 0 "${extra[@]}" 2>&1 >/dev/null)
      "$PYTHON" - "$case" "$round" "$ranks" "$log" >> "$out" <<'PY'
import json, re, sys
case, round_, ranks, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
summary = re.search(r"(\d+) prompt tokens, TTFT ([\d.]+) ms.*?(\d+) tokens, decode ([\d.]+) tok/s", log)
held = [float(m) for m in re.findall(r"holds ([\d.]+) MB", log)]
print(json.dumps({"case": case, "round": round_, "ranks": ranks, "prompt_tokens": int(summary[1]),
                  "ttft_ms": float(summary[2]), "tokens": int(summary[3]), "decode_tps": float(summary[4]),
                  "held_mb_per_rank": held}))
PY
      tail -1 "$out"
    done
  done
done
