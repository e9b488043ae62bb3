#!/usr/bin/env bash
# `make check-mac`: type-check and lint every crate, tests and examples included, for
# aarch64-apple-darwin — the Mac build's own code paths (Metal/Accelerate features of mlx-rs,
# IOKit and NSProcessInfo readers, the tray's macOS setup), with `-D warnings`.
#
# On a Mac that is plain `cargo check` and `cargo clippy`. Elsewhere no build script may need
# Apple's SDK, and nothing here changes what a Mac build compiles:
#   - mlx-sys takes its check-only branch (third_party/mlx-sys/check_only.rs, from Ferrite's
#     patch): MLX is not built or linked, the bindings come from the same mlx-c headers for the
#     same target, against the Darwin C headers zig ships (MLX_SYS_CHECK_ONLY lists them);
#   - C/Objective-C helpers compile with scripts/check-mac/cc (zig cc -target aarch64-macos).
# scripts/setup.sh --mac-check installs the target and zig (PyPI's `ziglang`).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
target=aarch64-apple-darwin
CARGO=${CARGO:-cargo}
if [ "$(uname -s)" != Darwin ]; then
  zig_lib=$root/third_party/ziglang/ziglang/lib
  export MLX_SYS_CHECK_ONLY="$zig_lib/include:$zig_lib/libc/include/any-darwin-any"
  export CC_aarch64_apple_darwin=$root/scripts/check-mac/cc
  export AR_aarch64_apple_darwin=$root/scripts/check-mac/ar
fi
$CARGO check --workspace --all-targets --target $target
$CARGO clippy --workspace --all-targets --target $target -- -D warnings
