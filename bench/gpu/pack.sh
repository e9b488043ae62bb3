#!/usr/bin/env bash
# Here, before a GPU session: packs what the device tool's runs carry into git-ignored
# folders, one per run (each run may carry 64 MiB with the working tree, ~28 MiB of it):
#   .gpu-carry/run1   the first runtime part
#   .gpu-carry/runN   one more runtime part each; the last also has the peer's wheels and the
#                     release `ferrite` (stripped, xz)
# The runtime's parts come from ../shared/gpu-runtime/pack.sh (made here once, into .gpu), cut
# again here at PART_SIZE (default 30M: three runs, the tree may keep the embedded model's
# weights, ~23 MB). PART_SIZE=40M packs two runs, one start fewer; then keep
# assets/models/ferrite-code-20m/model.safetensors out of the tree for both, so only checks
# that do not load the embedded model fit (qmm, verify-8b, compare-*, ops-35b, delta, batch-8b).
# Then, back to back (the machine goes back after 30 s idle):
#   run(carry [".gpu-carry/run1"]): bash .gpu-carry/run1/install.sh .gpu-carry/run1; bench/gpu/checks.sh --binary .gpu-carry/run1
#   ... one run per part, the same with runN ...; the last one's install prints env.sh, then
#   bench/gpu/checks.sh names what to measure (see there).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
runtime=$root/../shared/gpu-runtime
# The runtime must be the MLX the binary is built against (scripts/setup.sh pins both).
export MLX_VERSION=$(sed -n 's/^MLX_VERSION=\([0-9.]*\).*/\1/p' scripts/setup.sh)
export MLX_LM_VERSION=$(sed -n 's/^MLX_LM_VERSION=\([0-9.]*\).*/\1/p' scripts/setup.sh)
if [ ! -f .gpu/PARTS ] || [ "$(cat .gpu/VERSION 2>/dev/null)" != "$MLX_VERSION" ]; then
  # Parts of 30 MiB: each run carries the working tree (~28 MiB) too, within 64 MiB.
  rm -rf .gpu && PART_SIZE=30M bash "$runtime/pack.sh" .gpu
fi
grep -qx '/.gpu-carry/' .git/info/exclude 2>/dev/null || echo /.gpu-carry/ >> .git/info/exclude
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
cargo build --release -p ferrite-cli
rm -rf .gpu-carry && mkdir -p .gpu-carry
cat .gpu/mlx-cuda.part.* | split -b "${PART_SIZE:-30M}" -a 2 - .gpu-carry/mlx-cuda.part.
parts=$(ls .gpu-carry/mlx-cuda.part.* | wc -l)
i=0
for part in .gpu-carry/mlx-cuda.part.*; do
  i=$((i + 1)); dir=.gpu-carry/run$i
  mkdir -p "$dir"; mv "$part" "$dir/"; echo "$parts" > "$dir/PARTS"; cp .gpu/VERSION "$runtime/install.sh" "$dir/"
done
objcopy --strip-debug target/release/ferrite .gpu-carry/ferrite
# The binary rides with the last (smallest) part.
xz -T0 -6 -c .gpu-carry/ferrite > ".gpu-carry/run$i/ferrite.xz" && rm .gpu-carry/ferrite
cp -r .gpu/peer ".gpu-carry/run$i/"
# The vision reference (bench/vision.sh), carried on its own once the runtime is in (the last
# run has no room for it): mlx-vlm without its extras, the Pillow it resizes with, requests
# (its processor imports it), as scripts/setup.sh pins them; `checks.sh vision` installs them.
MLX_VLM_VERSION=$(sed -n 's/^MLX_VLM_VERSION=\([0-9.]*\).*/\1/p' scripts/setup.sh)
PILLOW_VERSION=$(sed -n 's/^PILLOW_VERSION=\([0-9.]*\).*/\1/p' scripts/setup.sh)
mkdir -p .gpu-carry/vision/wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .gpu-carry/vision/wheels \
  "mlx-vlm==$MLX_VLM_VERSION" "pillow==$PILLOW_VERSION" "requests>=2.31,<3" urllib3 idna certifi charset-normalizer
du -sh .gpu-carry/run*
echo "$i runs to carry, back to back: .gpu-carry/run1 .. run$i (then .gpu-carry/vision for \`checks.sh vision\`)"
