#!/usr/bin/env bash
# The prompt cache on a real agent session: Claude Code runs a ten-step tool session against
# `ferrite serve --model default` (answers scripted, see bench/agent_session.py) through a
# recording proxy; the recorded requests are then replayed against fresh servers with the
# cache off, on (memory), and on with the disk tier and a restart before the sixth request.
# Prints a table: per request, prompt tokens, tokens from the cache, and the time to the
# first content event each way. Target: from turn 2 on, TTFT with the cache <= 10% of the
# cold TTFT, and >= 95% of the earlier turn's prompt served from the cache; after the
# restart, the same from disk.
#
#   bench/prompt_cache.sh            (records once into bench/out/claude-session.json)
#   MODEL=DIR bench/prompt_cache.sh  replays the recording against another model (a GPU
#                                    machine: the 35B-A3B checkpoint, see bench/README.md)
set -euo pipefail
. "$(dirname "$0")/lib.sh"
MODEL=${MODEL:-default}
CLAUDE=${CLAUDE:-$root/third_party/agents/node_modules/.bin/claude}
session=$BENCH_DIR/claude-session.json
[ -f "$session" ] || "$PYTHON" "$root/bench/agent_session.py" record --ferrite "$FERRITE" --claude "$CLAUDE" --out "$session"
out=$BENCH_DIR/prompt_cache.jsonl
: > "$out"
for cache in off on; do
  "$PYTHON" "$root/bench/agent_session.py" replay --ferrite "$FERRITE" --session "$session" --model "$MODEL" --cache "$cache" | tee -a "$out"
done
"$PYTHON" "$root/bench/agent_session.py" replay --ferrite "$FERRITE" --session "$session" --model "$MODEL" --cache disk --restart-at 5 | tee -a "$out"
"$PYTHON" - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
off = {r["request"]: r for r in rows if r["cache"] == "off"}
on = {r["request"]: r for r in rows if r["cache"] == "on"}
disk = {r["request"]: r for r in rows if r["cache"] == "disk"}
print("| request | tools | prompt tokens | from cache (on) | TTFT off (s) | TTFT on (s) | on / off | from cache (disk, restart before 5) | TTFT disk (s) | disk / off |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for i in sorted(on):
    a, b, d = off[i], on[i], disk[i]
    ratio = lambda x: x["ttft_s"] / a["ttft_s"] if a["ttft_s"] else float("nan")
    mark = " (restarted)" if d["restarted"] else ""
    print(f"| {i} | {b['tools']} | {b['prompt_tokens']} | {b['cached_tokens']} | {a['ttft_s']:.2f} | {b['ttft_s']:.2f} | "
          f"{ratio(b):.3f} | {d['cached_tokens']}{mark} | {d['ttft_s']:.2f} | {ratio(d):.3f} |")
mib = lambda b: f"{(b or 0) / 2**20:.1f}"
print()
print("| request | memory tier (on), MiB | its budget, MiB | MLX active (on), MiB | disk tier (disk), MiB |")
print("| --- | --- | --- | --- | --- |")
for i in sorted(on):
    b, d = on[i], disk[i]
    print(f"| {i} | {mib(b['cache_bytes'])} | {mib(b['cache_budget_bytes'])} | {mib(b['mlx_active_bytes'])} | {mib(d['disk_bytes'])} |")
PY
