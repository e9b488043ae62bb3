#!/usr/bin/env bash
# On the GPU machine, from the checkout root: installs the carried runtime part(s), and the
# carried `ferrite` once; then runs the named checks, each bounded, writing under ~/gpu-out,
# and leaves everything as one $OUT/results.tar (the device tool returns at most 8 files);
# $OUT/partial.tar, rewritten every 30 s, holds what a check stopped by the call's limit wrote.
#   bench/gpu/checks.sh --carried DIR [CHECK ...]
# Checks (each a command of this repo, as the results files quote them):
#   tune-embedded   5 `ferrite tune` runs on the embedded model with its block drafter (DRAFTER_DIR
#                   or the shipped one, passed by path: a model given by path has no catalog
#                   drafter), so plain, MTP and block depths compete; each one's wall seconds
#                   in the log, then a 30-round reference (TUNE_REF=0 skips it; TUNE_ARGS adds
#                   arguments; TUNE_TIMEOUT bounds a run, default 150 s; TUNE_RUNS numbers the
#                   runs, default "1 2 3 4 5")
#   tune-next       the same on a Qwen3-Next-shaped checkpoint with an MTP head (next-small-4bit)
#   depth           bench/depth.sh on the embedded model (DEPTH_ARGS adds arguments)
#   spec-embedded   `ferrite bench --spec` on the embedded model with its block drafter (held-out
#                   code, 64 tokens, temperature 0; then the 5 windows of files never trained
#                   on, heldout-code-unseen.json): plain, MTP and block depths with their
#                   verify costs, and the controller from each (SPEC_TIMEOUT, default 300 s),
#                   after an untimed run of 16 tokens (the fresh machine's compiles)
#   depth-block     the same with its block drafter, from block depth 4
#   batch-8b        `ferrite dev batch` on the 8B shape (engine only, no HTTP)
#   clients-8b      bench/clients.sh on the 8B shape against mlx_lm.server
#   clients-35b     the same on the Qwen3-Next-shaped 35B-A3B
#   delta           the gated delta paths: `ferrite inspect` (the CUDA kernels' self-checks at
#                   load), greedy answers on the ops, cuda-kernel and cuda-fused paths, plain and
#                   speculative (a summary says which agree), and bench/mlx_lm_mac_like.py's
#                   check of the peer's port
#   compare-dense   bench/compare.sh on the dense 8B and 32B shapes (DENSE names them) against
#                   mlx-lm (ops), with SIZES, PROCESSES, PROFILE as compare.sh reads them
#   drafter-data    the target's own greedy continuations of corpus text (train/generate.py:
#                   GEN_ROWS rows of GEN_SEQ tokens (default 3072 of 512), GEN_PROMPT of them
#                   the corpus' (default 64), from train.bin; 256 from heldout.bin; GEN_BATCH at
#                   once, default 32: 96 and more stopped MLX 0.32.4's CUDA build with
#                   "cudaGraphAddKernelNode ... invalid argument"; GEN_TIMEOUT, default 300 s,
#                   of which the rows made 40 s before it are written: fewer, not none;
#                   GEN_SEED, default 0, draws other training windows, never other held-out ones)
#                   into ~/train-data, which drafter-train then mixes in (TRAIN_SHARE, default
#                   0.5; TRAIN_SEQ must then be GEN_SEQ); both sets also come back xz'ed as
#                   $OUT/{train,heldout}-generated.bin.xz with their .json, and a later
#                   session that carries them beside train.bin.xz skips making them again
#   drafter-train   trains a DFlash block drafter for the embedded model (train/drafter.py, for
#                   TRAIN_MINUTES, default 6, on the carried train.bin.xz and heldout.bin, made
#                   as train/README.md says; TRAIN_INIT=DIR trains that drafter further,
#                   TRAIN_LR its rate; TRAIN_SEQ tokens a row, default 512, TRAIN_BLOCKS
#                   anchors a row, default 32) into ~/gpu-out/drafter
#   drafter-bench   bench/acceptance.sh with that drafter (or DRAFTER_DIR's): plain, MTP depths
#                   and block depths, one run
# DRAFTER_DIR also names the drafter spec-embedded and depth-block run (default the shipped one);
# LABEL, when set, ends their results' names (two drafters in one call: spec-embedded-LABEL.json).
#   verify-8b       a z-lab-shaped block drafter (5 layers, blocks of 16, `ferrite dev
#                   make-drafter`) beside the dense 8B shape: `ferrite bench --spec` times its
#                   block passes and the verify passes against plain steps (random weights:
#                   nothing is accepted; the costs are the point)
#                   (MATMUL_PATHS: one run each, e.g. "cuda-rows mlx"; default auto)
#   passes          what a verify pass of N positions costs against a decode step, built and run
#                   alone: `ferrite dev ops --positions` and bench/mlx_lm_ops.py's on the 8B shape
#                   after 512 tokens (N = 1 2 4 8 16, the two engines alternating, twice; Ferrite
#                   once more with --matmul-path cuda-rows), and Ferrite's on the embedded model
#   qmm             bench/qmm_small_m.py: MLX's quantized matmul (also on rows padded to 16) and
#                   the engine's few-rows and tensor-core kernels for 1 to 16 rows on the 8B
#                   shape's projections, checked against float32
#   vision          bench/vision.sh: Ferrite's vision tower against mlx-vlm's on the same patches
#                   (WIDTH, HEIGHT, ROUNDS, RUNS as it reads them; default 1024x768, 3, 3)
#   vision-prefill  bench/vision_prefill.sh: a whole prompt with a picture to its first token,
#                   Ferrite against mlx-vlm's model (PRESET, WIDTH, HEIGHT, TEXT, ROUNDS, RUNS;
#                   carried like vision)
#   ops-35b         `ferrite dev ops` on the 35B-A3B shape, on each delta path, and mlx-lm's count
#                   (PEER_OPS=0 skips mlx-lm's)
# PATHS (default "cuda-fused ops cuda-kernel") names the delta paths `delta` and `ops-35b` run
# (DELTA_PATHS, when set, `delta`'s).
#   compare-small   the same on the small Qwen3-Next shape (SIZES default 128 2048)
#   compare-35b     bench/compare.sh on the 35B-A3B shape against mlx-lm (ops) and the Mac-like
#                   peer (SIZES from the environment, default 128 2048 8192; PEERS, PROFILE,
#                   PROCESSES as compare.sh reads them; COMPARE_TIMEOUT, default 560 s: keep it
#                   under the device call's limit)
set -u
[ "${1:-}" = --carried ] || { echo "usage: $0 --carried DIR [CHECK ...]" >&2; exit 2; }
carried=$2; shift 2
bash "$carried/install.sh" "$carried"; rc=$?
[ -f "$carried/ferrite.xz" ] && xz -d -c "$carried/ferrite.xz" > ~/ferrite && chmod +x ~/ferrite
[ $rc = 0 ] || exit 0  # parts still to carry
. ~/.mlx-cuda/env.sh
export FERRITE=~/ferrite PYTHON=python3 BENCH_DIR=~/bench-out
res=~/gpu-out; mkdir -p "$res" "$BENCH_DIR"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$res/log.txt"; }
. bench/lib.sh
# The CUDA modules Ferrite's processes share (engine::kernel_cache): a fresh process compiles
# only what none before it did.
ptx_shared() { find "${TMPDIR:-/tmp}"/ferrite-mlx-*/kernels -name '*.ptx' 2>/dev/null | wc -l; }
# The shared modules by the time each was compiled (a hard link keeps its file's time): where a
# fresh machine's first minutes go.
ptx_times() { find "${TMPDIR:-/tmp}"/ferrite-mlx-*/kernels -name '*.ptx' -printf '%TT %s %f\n' 2>/dev/null | sort; }
tune_runs() {  # MODEL LABEL [ARGS of ferrite tune ...]
  local i
  for i in ${TUNE_RUNS:-1 2 3 4 5}; do
    log "tune $2 run $i"
    local began=$SECONDS
    FERRITE_CONFIG_DIR=~/tcfg-$2-$i timeout ${TUNE_TIMEOUT:-150} "$FERRITE" tune --model "$1" --prompts 2 --tokens 48 --budget 60 \
      "${@:3}" ${TUNE_ARGS:-} > "$res/tune-$2-$i.txt" 2>&1
    log "tune $2 run $i: exit $?, $((SECONDS - began)) s (budget 60 s); shared CUDA modules: $(ptx_shared)"
    ptx_times > "$res/ptx-after-tune-$2-$i.txt"
    cp ~/tcfg-$2-$i/tuning.json "$res/tune-$2-$i.json" 2>/dev/null
    tar -C "$res" -cf "$OUT/results.tar" .
  done
  [ "${TUNE_REF:-1}" = 0 ] && return
  log "tune $2 reference"
  FERRITE_CONFIG_DIR=~/tcfg-$2-ref timeout 300 "$FERRITE" tune --model "$1" --prompts 2 --tokens 48 --rounds 30 \
    --budget 280 "${@:3}" > "$res/tune-$2-ref.txt" 2>&1
  cp ~/tcfg-$2-ref/tuning.json "$res/tune-$2-ref.json" 2>/dev/null
}
embedded=assets/models/ferrite-code-20m
drafter=${DRAFTER_DIR:-assets/models/ferrite-code-20m-dflash}
train_data() {  # the corpus ids, from the carried train.bin.xz and heldout.bin, into ~/train-data
  data=~/train-data; mkdir -p $data
  [ -f $data/train.bin ] || { [ -f "$carried/train.bin.xz" ] && xz -d -c "$carried/train.bin.xz" > $data/train.bin \
    && cp "$carried/heldout.bin" $data/; }
  local split
  for split in train heldout; do
    [ -f $data/$split-generated.bin ] || [ ! -f "$carried/$split-generated.bin.xz" ] \
      || xz -d -c "$carried/$split-generated.bin.xz" > $data/$split-generated.bin
    # How the rows were made (their prompt's length places drafter.py's anchors).
    [ -f $data/$split-generated.json ] || [ ! -f "$carried/$split-generated.json" ] \
      || cp "$carried/$split-generated.json" $data/
  done
}
tag=${LABEL:+-$LABEL}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$res/gpu.txt" 2>&1
# A check the call's time limit stops mid-way (a drafter-train whose budget ran out) still
# brings back what it wrote so far: results.tar is written only between checks. Renamed
# into place, so the limit never leaves a half-written partial.tar.
( while sleep 30; do tar -C "$res" -cf "$OUT/partial.tar.tmp" . 2>/dev/null && mv "$OUT/partial.tar.tmp" "$OUT/partial.tar"; done ) \
  > /dev/null 2>&1 &  # its sleep outlives it: it must not hold the call's output open
saver=$!
trap 'kill $saver 2>/dev/null' EXIT
for check in "$@"; do
  log "$check"
  case $check in
    tune-embedded) tune_runs "$embedded" embedded --drafter "$drafter" ;;
    tune-next) tune_runs "$(checkpoint next-small-4bit)" next-small ;;
    depth) timeout ${DEPTH_TIMEOUT:-180} bench/depth.sh "$embedded" --rounds 3 ${DEPTH_ARGS:-} > "$res/depth.txt" 2>&1 ;;
    spec-embedded)
      spec() { timeout ${SPEC_TIMEOUT:-300} "$FERRITE" bench --spec --model "$embedded" \
        --drafter "$drafter" --runs 1 --temp 0 "$@"; }
      # A short untimed run first: on a fresh machine the controller's first cycles met shapes
      # no process had compiled yet (30 tok/s once, bench/results/dflash.md).
      spec --prompt-ids bench/prompts/heldout-code.json --gen-tokens 16 > /dev/null 2>&1
      spec --prompt-ids bench/prompts/heldout-code.json --gen-tokens 64 > "$res/spec-embedded$tag.json" \
        2> "$res/spec-embedded$tag.txt"
      # The windows of files never trained on at any version (bench/results/dflash.md).
      spec --prompt-ids bench/prompts/heldout-code-unseen.json --gen-tokens 64 > "$res/spec-embedded-unseen$tag.json" \
        2> "$res/spec-embedded-unseen$tag.txt" ;;
    depth-block) timeout ${DEPTH_TIMEOUT:-180} bench/depth.sh "$embedded" --rounds 3 --depth 4 \
      --drafter "$drafter" > "$res/depth-block$tag.txt" 2>&1 ;;
    batch-8b) timeout 240 "$FERRITE" dev batch --model "$(checkpoint 8b-4bit)" --streams 2,4,8 --tokens 48 --rounds 3 \
      > "$res/batch-8b.jsonl" 2> "$res/batch-8b.err" ;;
    clients-8b | clients-35b)
      case=8b-4bit; [ "$check" = clients-35b ] && case=next-35b-a3b-4bit
      PROFILE=turbo timeout 420 bench/clients.sh "$(checkpoint $case)" --clients 1,2,4,8 --max-tokens 64 --rounds 3 \
        --warm-tokens 8 > "$res/$check.txt" 2>&1
      cp "$BENCH_DIR/mlx_lm.server.log" "$res/$check-mlx_lm.log" 2>/dev/null ;;
    delta)
      for c in next-small-4bit; do
        dir=$(checkpoint $c)
        timeout 150 "$FERRITE" inspect "$dir" > "$res/inspect-$c.txt" 2>&1
        long=$(printf 'fn main() { let x = 1; println!("{x}"); } %.0s' $(seq 12))
        for path in ${DELTA_PATHS:-${PATHS:-cuda-fused ops cuda-kernel}}; do
          for depth in 0 2; do
            timeout 180 "$FERRITE" generate --model "$dir" --prompt "$long" --max-tokens 48 --draft-depth $depth \
              --delta-path $path > "$res/answer-$path-$depth.txt" 2> "$res/answer-$path-$depth.err"
            log "answer $path depth $depth: $(md5sum < "$res/answer-$path-$depth.txt" | cut -c1-8)"
          done
        done
      done
      timeout 120 python3 bench/mlx_lm_mac_like.py > "$res/mac-like-check.json" 2>&1 ;;
    drafter-data)
      train_data
      for split in train heldout; do
        # GEN_SEED draws other training windows (a further run on fresh rows); the held-out
        # rows stay the same, so evaluations compare.
        rows=${GEN_ROWS:-3072} seed=${GEN_SEED:-0}; [ $split = heldout ] && rows=256 seed=0
        timeout ${GEN_TIMEOUT:-300} python3 train/generate.py --target "$embedded" --source $data/$split.bin --rows $rows \
          --batch ${GEN_BATCH:-32} --seq ${GEN_SEQ:-512} --prompt ${GEN_PROMPT:-64} --seed $seed --seconds $(( ${GEN_TIMEOUT:-300} - 40 )) \
          --out $data/$split-generated.bin > "$res/drafter-data-$split.txt" 2>&1
        log "drafter-data $split: exit $?, $(tail -1 "$res/drafter-data-$split.txt")"
        cp $data/$split-generated.json "$res/" 2>/dev/null
        cp $data/$split-generated.json "$OUT/" 2>/dev/null
        xz -T0 -6 -c $data/$split-generated.bin > "$OUT/$split-generated.bin.xz"
      done ;;
    drafter-train)
      train_data
      minutes=${TRAIN_MINUTES:-6}
      timeout $(( ${minutes%.*} * 60 + 150 )) python3 train/drafter.py --data $data --out "$res/drafter" --minutes "$minutes" \
        --batch ${TRAIN_BATCH:-32} --seq ${TRAIN_SEQ:-512} --blocks ${TRAIN_BLOCKS:-32} --steps ${TRAIN_STEPS:-20000} --eval-every ${TRAIN_EVAL:-500} ${TRAIN_INIT:+--init "$TRAIN_INIT"} ${TRAIN_LR:+--lr $TRAIN_LR} \
        --generated-share ${TRAIN_SHARE:-0.5} > "$res/drafter-train.txt" 2>&1 ;;
    verify-8b)
      target=$(checkpoint 8b-4bit); drafter_8b=$BENCH_DIR/8b-dflash-b16
      [ -f "$drafter_8b/config.json" ] || "$FERRITE" dev make-drafter --target "$target" --layers 5 --block-size 16 \
        --intermediate-size 12288 --bits 4 --out "$drafter_8b" > "$res/verify-8b-make.txt" 2>&1
      ids=$(PROMPT_TOKENS=512 prompt_ids)
      timeout 60 "$FERRITE" inspect "$target" > "$res/inspect-8b.txt" 2>&1
      for path in ${MATMUL_PATHS:-auto}; do
        timeout ${VERIFY_TIMEOUT:-300} "$FERRITE" bench --spec --model "$target" --drafter "$drafter_8b" --prompt-ids "$ids" \
          --gen-tokens 48 --runs 1 --matmul-path $path > "$res/verify-8b-$path.txt" 2>&1
        tar -C "$res" -cf "$OUT/results.tar" .
      done ;;
    passes)
      target=$(checkpoint 8b-4bit); at="--context 512 --positions 1 --positions 2 --positions 4 --positions 8 --positions 16"
      for round in 1 2; do
        timeout 150 "$FERRITE" dev ops --model "$target" $at --json >> "$res/passes-8b.jsonl" 2>> "$res/passes-8b.err"
        timeout 150 python3 bench/mlx_lm_ops.py --model "$target" $at >> "$res/passes-8b.jsonl" 2>> "$res/passes-8b.err"
        tar -C "$res" -cf "$OUT/results.tar" .
      done
      timeout 150 "$FERRITE" dev ops --model "$target" $at --json --matmul-path cuda-rows > "$res/passes-8b-cuda-rows.jsonl" 2>&1
      timeout 150 "$FERRITE" dev ops --model "$embedded" --context 512 --positions 1 --positions 2 --positions 3 \
        --positions 8 --json > "$res/passes-embedded.jsonl" 2>&1 ;;
    qmm)
      timeout ${QMM_TIMEOUT:-150} python3 bench/qmm_small_m.py > "$res/qmm.jsonl" 2>&1 ;;
    drafter-bench)
      DRAFTER="${DRAFTER_DIR:-$res/drafter}" BENCH_DIR="$res" timeout 200 bench/acceptance.sh > "$res/drafter-acceptance.txt" 2>&1 ;;
    vision | vision-prefill)
      # Carried as .gpu-carry/vision (bench/gpu/pack.sh): the mlx-vlm side's wheels.
      if ls "$carried"/wheels/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target ~/.mlx-cuda "$carried"/wheels/*.whl
      fi
      script=$(echo "$check" | tr - _)
      timeout ${VISION_TIMEOUT:-400} "bench/$script.sh" > "$res/$check.txt" 2>&1
      cp "$BENCH_DIR/$script.jsonl" "$res/$check.jsonl" 2>/dev/null ;;
    ops-35b)
      dir=$(checkpoint next-35b-a3b-4bit)
      for path in ${PATHS:-cuda-fused ops cuda-kernel}; do
        timeout 200 "$FERRITE" dev ops --model "$dir" --context 128 --context 8192 --delta-path $path > "$res/ops-35b-$path.txt" 2>&1
      done
      [ "${PEER_OPS:-1}" = 0 ] || timeout 200 python3 bench/mlx_lm_ops.py --model "$dir" --context 128 > "$res/ops-35b-mlx-lm.txt" 2>&1 ;;
    compare-small)
      PEERS="${PEERS:-ops mac-like}" SIZES="${SIZES:-128 2048}" timeout 300 bench/compare.sh next-small-4bit > "$res/compare-small.txt" 2>&1 ;;
    compare-35b)
      PEERS="${PEERS:-ops mac-like}" timeout "${COMPARE_TIMEOUT:-560}" bench/compare.sh next-35b-a3b-4bit \
        > "$res/compare-35b-$(echo ${SIZES:-all} | tr " " -).txt" 2>&1
      # compare.sh writes its rows as each process ends: keep them when the timeout stopped it.
      cp "$BENCH_DIR/compare-run.jsonl" "$res/compare-35b-rows-$(date -u +%H%M%S).jsonl" 2>/dev/null ;;
    compare-dense)
      # Dense shapes have no delta rule: mlx-lm's ops path is the peer a Mac runs too.
      PEERS="${PEERS:-ops}" timeout "${COMPARE_TIMEOUT:-560}" bench/compare.sh ${DENSE:-8b-4bit 32b-4bit} \
        > "$res/compare-dense.txt" 2>&1
      cp "$BENCH_DIR/compare-run.jsonl" "$res/compare-dense-rows-$(date -u +%H%M%S).jsonl" 2>/dev/null ;;
    *) log "unknown check $check" ;;
  esac
  # After each check, so a run stopped at its time limit still brings back what it finished.
  tar -C "$res" -cf "$OUT/results.tar" .
done
log done
tar -C "$res" -cf "$OUT/results.tar" .
