#!/usr/bin/env bash
# A whole prompt with one picture, to its first token: Ferrite against mlx-vlm 0.7.10 on the same
# MLX. A Qwen3.5 text model (`ferrite dev make-checkpoint`, PRESET, Qwen's layout) with a
# Qwen3.5-shaped vision tower added by mlx-vlm (random weights, TOWER_DTYPE), one picture of
# WIDTH x HEIGHT cut by Ferrite's processor (mlx-vlm runs those patches and the same token ids),
# TEXT tokens of text around it; ROUNDS rounds alternating the engines, each a fresh process
# timing RUNS prompts after a warm-up. Ferrite's time includes its own preprocessing of the
# picture; mlx-vlm's starts from the patches. One JSON line per process, then medians.
#   bench/vision_prefill.sh      (PRESET=small WIDTH=1024 HEIGHT=768 TEXT=64 ROUNDS=3 RUNS=3)
set -euo pipefail
. "$(dirname "$0")/lib.sh"
PRESET=${PRESET:-small} WIDTH=${WIDTH:-1024} HEIGHT=${HEIGHT:-768} TEXT=${TEXT:-64}
ROUNDS=${ROUNDS:-3} RUNS=${RUNS:-3} TOWER_DTYPE=${TOWER_DTYPE:-bfloat16}
model=$BENCH_DIR/qwen3_5-$PRESET-sees-$DTYPE
if [ ! -f "$model/preprocessor_config.json" ]; then
  rm -rf "$model"
  "$FERRITE" dev make-checkpoint --arch qwen3_5 --preset "$PRESET" --layout transformers --dtype "$DTYPE" --out "$model" >&2
  hidden=$("$PYTHON" -c "import json,sys; c=json.load(open(sys.argv[1])); print(c.get('text_config', c)['hidden_size'])" "$model/config.json")
  # Qwen's vision tokens, special tokens after the tokenizer's own (its vocabulary is smaller
  # than the model's); prints the first id: start, end and image follow one another.
  next=$("$PYTHON" - "$model/tokenizer.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
first = max(a["id"] for a in t["added_tokens"]) + 1
for i, content in enumerate(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]):
    t["added_tokens"].append({"id": first + i, "content": content, "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True})
json.dump(t, open(sys.argv[1], "w"))
print(first)
PY
)
  # Qwen3.5's tower (bench/mlx_vlm_vision_tower.py's) into the text model's width.
  vision=$(cd "$root/bench" && "$PYTHON" -c "import json, sys; from mlx_vlm_vision_tower import QWEN3_5
print(json.dumps(dict(QWEN3_5, out_hidden_size=int(sys.argv[1]))))" "$hidden")
  "$PYTHON" "$root/tests/reference/mlx_vlm_vision_model.py" --dir "$model" --vision "$vision" --tower-only \
    --tower-dtype "$TOWER_DTYPE" --vision-start "$next" --vision-end $((next + 1)) --image-token $((next + 2))
  echo '{"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 65536, "longest_edge": 16777216}}' > "$model/preprocessor_config.json"
fi
out=$BENCH_DIR/vision_prefill.jsonl
: > "$out"
for round in $(seq "$ROUNDS"); do
  line=$("$FERRITE" dev vision-prefill --model "$model" --width "$WIDTH" --height "$HEIGHT" --text "$TEXT" --runs "$RUNS" \
    --patches-out "$BENCH_DIR/vision-prefill-patches.f32" --tokens-out "$BENCH_DIR/vision-prefill-tokens.json")
  echo "$line" | tee -a "$out"
  grid=$(echo "$line" | "$PYTHON" -c "import json,sys; print(','.join(map(str, json.load(sys.stdin)['grid'])))")
  "$PYTHON" "$root/bench/mlx_vlm_prefill.py" --dir "$model" --tokens "$BENCH_DIR/vision-prefill-tokens.json" \
    --patches "$BENCH_DIR/vision-prefill-patches.f32" --grid "$grid" --runs "$RUNS" | tee -a "$out"
done
"$PYTHON" - "$out" <<'PY'
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1])]
for engine in dict.fromkeys(r["engine"] for r in rows):
    s = [x for r in rows if r["engine"] == engine for x in r["seconds"]]
    tokens = {r["prompt_tokens"] for r in rows if r["engine"] == engine}
    print(f"{engine:8} median {statistics.median(s):.3f} s [{min(s):.3f}-{max(s):.3f}] over {len(s)} prompts of {sorted(tokens)} tokens")
firsts = {r["engine"]: r["first"] for r in rows}
if len(set(map(tuple, firsts.values()))) > 1:
    sys.exit(f"the engines' first tokens differ (random weights in bf16 may tie; look before trusting the times): {firsts}")
PY
