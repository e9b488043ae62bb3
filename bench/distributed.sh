#!/usr/bin/env bash
# A model split across two ranks (`--hosts`, tensor parallelism) against the whole model in one
# process, and against mlx-lm's own tensor-parallel generation (mlx.launch + its sharded_load,
# for the architectures mlx-lm 0.32 shards: qwen3, qwen3_moe) on the same checkpoint and prompt:
# decode tok/s, TTFT and the memory each rank holds; the settings alternate, ROUNDS fresh
# processes each. One JSON line per run in $BENCH_DIR/distributed.jsonl.
#   bench/distributed.sh [CASE...]     (cases from lib.sh; default small-4bit next-small-4bit)
# PEER=0 leaves mlx-lm out (on this CPU its quantized matmuls make a 0.6b-4bit run take
# many minutes).
# Here: two ranks on loopback, ring backend. On a GPU host with two GPUs: BACKEND=nccl
# (and NCCL_NVLS_ENABLE=0). Ferrite holds the weights in the form it chooses (on this CPU a
# small quantized model is dequantized at load: its memory is not mlx-lm's packed one).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
ROUNDS=${ROUNDS:-3}
TOKENS=${TOKENS:-128}
BACKEND=${BACKEND:-ring}
PROMPT_REPEATS=${PROMPT_REPEATS:-10}
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(small-4bit next-small-4bit)
PEER=${PEER:-1}
hosts=$BENCH_DIR/hosts-2.json
echo '[{"ips": ["127.0.0.1"]}, {"ips": ["127.0.0.1"]}]' > "$hosts"
prompt_file=$BENCH_DIR/distributed-prompt.txt
for _ in $(seq 1 "$PROMPT_REPEATS"); do printf 'def merge(a, b):\n    out = []\n'; done > "$prompt_file"
out=$BENCH_DIR/distributed.jsonl
: > "$out"

ferrite_run() { # case round ranks model
  local extra=() log
  [ "$3" = 2 ] && extra=(--hosts "$hosts" --backend "$BACKEND")
  log=$(RUST_LOG=warn "$FERRITE" generate -m "$4" -p "$(cat "$prompt_file")" --max-tokens "$TOKENS" \
    --draft-depth 0 "${extra[@]}" 2>&1 >/dev/null)
  "$PYTHON" - "$1" "$2" "$3" "$log" <<'PY'
import json, re, sys
case, round_, ranks, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
s = re.search(r"(\d+) prompt tokens, TTFT ([\d.]+) ms.*?(\d+) tokens, decode ([\d.]+) tok/s", log)
if s is None:
    sys.exit(f"ferrite ({ranks} ranks) failed: {log[-2000:]}")
print(json.dumps({"engine": "ferrite", "case": case, "round": round_, "ranks": ranks,
                  "prompt_tokens": int(s[1]), "ttft_ms": float(s[2]), "tokens": int(s[3]),
                  "decode_tps": float(s[4]), "held_mb_per_rank": [float(m) for m in re.findall(r"holds ([\d.]+) MB", log)]}))
PY
}

mlx_lm_run() { # case round model
  "$root/third_party/venv/bin/mlx.launch" --backend "$BACKEND" -n 2 -- "$PYTHON" "$root/bench/mlx_lm_sharded.py" \
    --model "$3" --prompt-file "$prompt_file" --gen-tokens "$TOKENS" 2>/dev/null |
    "$PYTHON" -c '
import json, sys
ranks = sorted((json.loads(l) for l in sys.stdin if l.startswith("{")), key=lambda r: r["rank"])
r0 = ranks[0]
print(json.dumps({"engine": "mlx-lm", "case": sys.argv[1], "round": int(sys.argv[2]), "ranks": len(ranks),
                  "prompt_tokens": r0["prompt_tokens"], "ttft_ms": r0["ttft_ms"], "tokens": r0["tokens"],
                  "decode_tps": r0["decode_tps"], "held_mb_per_rank": [r["held_mb"] for r in ranks]}))' "$1" "$2"
}

for case in "${cases[@]}"; do
  model=$(checkpoint "$case")
  shards=$("$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["model_type"] in ("qwen3", "qwen3_moe"))' "$model/config.json")
  for round in $(seq 1 "$ROUNDS"); do
    ferrite_run "$case" "$round" 1 "$model" | tee -a "$out"
    ferrite_run "$case" "$round" 2 "$model" | tee -a "$out"
    if [ "$shards" = True ] && [ "$PEER" = 1 ]; then
      mlx_lm_run "$case" "$round" "$model" | tee -a "$out"
    fi
  done
done
