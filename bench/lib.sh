# Shared by the bench/ scripts: defaults, the checkpoint cases, the prompt ids file.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FERRITE=${FERRITE:-$root/target/release/ferrite}
PYTHON=${PYTHON:-$root/third_party/venv/bin/python}
BENCH_DIR=${BENCH_DIR:-$root/bench/out}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
DTYPE=${DTYPE:-bf16}
mkdir -p "$BENCH_DIR"

# make-checkpoint arguments for a case name.
case_args() {
  case $1 in
    tiny-4bit) echo --arch qwen3 --preset tiny --bits 4 --group-size 32 ;;
    small-4bit) echo --arch qwen3 --preset small --bits 4 --group-size 64 ;;
    0.6b-4bit) echo --arch qwen3 --preset 0.6b --bits 4 --group-size 64 ;;
    8b-4bit) echo --arch qwen3 --preset 8b --bits 4 --group-size 64 ;;
    32b-4bit) echo --arch qwen3 --preset 32b --bits 4 --group-size 64 ;;
    30b-a3b-4bit) echo --arch qwen3_moe --preset 30b-a3b --bits 4 --group-size 64 ;;
    next-tiny-4bit) echo --arch qwen3_next --preset tiny --bits 4 --group-size 32 --mtp ;;
    next-small-4bit) echo --arch qwen3_next --preset small --bits 4 --group-size 32 --mtp ;;
    next-35b-a3b-4bit) echo --arch qwen3_next --preset 35b-a3b --bits 4 --group-size 64 --mtp ;;
    next-80b-a3b-4bit) echo --arch qwen3_next --preset 80b-a3b --bits 4 --group-size 64 --mtp ;;
    *) echo "unknown case $1" >&2; return 2 ;;
  esac
}

# Makes the case's checkpoint once; prints its folder.
checkpoint() {
  local args dir=$BENCH_DIR/$1-$DTYPE
  args=$(case_args "$1") || exit 2
  # shellcheck disable=SC2086
  [ -f "$dir/config.json" ] || "$FERRITE" dev make-checkpoint $args --dtype "$DTYPE" --out "$dir" >&2
  echo "$dir"
}

# Writes the prompt ids both engines read; prints the file. Ids below 400 exist in every
# preset's tokenizer; the formula only has to be shared.
prompt_ids() {
  local ids=$BENCH_DIR/prompt-$PROMPT_TOKENS.json
  "$PYTHON" -c "import json,sys; n=int(sys.argv[1]); print(json.dumps([(i*37+11)%400 for i in range(n)]))" "$PROMPT_TOKENS" > "$ids"
  echo "$ids"
}
