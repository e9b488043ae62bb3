#!/usr/bin/env bash
# `make bundle`: the menu-bar app packaged by Tauri's bundler (@tauri-apps/cli, pinned in
# scripts/setup.sh). On a Mac: Ferrite.app (LSUIElement, hardened runtime with
# src-tauri/Entitlements.plist, icon.icns) and a .dmg, in target/release/bundle/{macos,dmg}. On
# Linux: a .deb that carries libmlx.so and MLX's BLAS (the forwarder in front of OpenBLAS)
# under /usr/lib/ferrite and depends on Debian's OpenBLAS, WebKitGTK and appindicator, in
# target/release/bundle/deb. (Tauri's AppImage needs its tools from GitHub at build time, which
# this project's machines cannot reach: `BUNDLES=deb,appimage make bundle` where they can.)
#
#   scripts/bundle.sh           release build and bundle
#   scripts/bundle.sh --check   (make test) a debug build bundled, then the package checked:
#                               its files, its dependencies, and that its binary loads the
#                               libmlx.so and BLAS it carries
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
cli=$root/third_party/tauri-cli/node_modules/.bin/tauri
[ -x "$cli" ] || { echo "bundle: run scripts/setup.sh --bundle first (installs @tauri-apps/cli)"; exit 1; }
check=0
[ "${1:-}" = --check ] && check=1
profile=release
flags=()
if [ $check = 1 ]; then profile=debug; flags+=(--debug); fi
case "$(uname -s)" in
  Darwin) bundles=${BUNDLES:-app,dmg} ;;
  *) bundles=${BUNDLES:-deb} ;;
esac
(cd src-tauri && "$cli" build "${flags[@]}" --bundles "$bundles" --ci)
out=$root/target/$profile/bundle
find "$out" -maxdepth 2 \( -name '*.deb' -o -name '*.AppImage' -o -name '*.app' -o -name '*.dmg' \) -print
[ $check = 1 ] || exit 0

fail() { echo "bundle check: $*" >&2; exit 1; }
if [ "$(uname -s)" = Darwin ]; then
  plist=$out/macos/Ferrite.app/Contents/Info.plist
  [ "$(/usr/libexec/PlistBuddy -c 'Print :LSUIElement' "$plist")" = true ] || fail "$plist: LSUIElement is not set"
  echo "bundle check: Ferrite.app is a menu-bar app (LSUIElement)"
  exit 0
fi
# Linux: the .deb.
deb=$(ls "$out"/deb/*.deb)
files=$(dpkg-deb -c "$deb" | awk '{ sub(/^\.\//, "", $6); print $6 }')
for want in usr/bin/ferrite-app usr/share/applications/Ferrite.desktop \
  usr/share/icons/hicolor/128x128/apps/ferrite-app.png usr/lib/ferrite/mlx/lib/libmlx.so \
  usr/lib/ferrite/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0 usr/lib/ferrite/mlx_cpu.libs/liblapack-86b2c207.so.3.10.0 \
  usr/lib/Ferrite/assets/models/ferrite-code-20m/model.safetensors; do
  grep -qx "$want" <<<"$files" || fail "$deb lacks $want"
done
depends=$(dpkg-deb -f "$deb" Depends)
for want in libopenblas0-pthread libwebkit2gtk-4.1-0 libayatana-appindicator3-1; do
  grep -q "$want" <<<"$depends" || fail "$deb does not depend on $want ($depends)"
done
unpacked=$(mktemp -d)
trap 'rm -rf "$unpacked"' EXIT
dpkg-deb -x "$deb" "$unpacked"
# Installed, the binary finds the libmlx.so it carries first, and that one its BLAS.
ldd "$unpacked/usr/bin/ferrite-app" | grep -q "libmlx.so => $unpacked/usr/bin/../lib/ferrite/mlx/lib/libmlx.so" \
  || fail "the packaged ferrite-app does not load the packaged libmlx.so: $(ldd "$unpacked/usr/bin/ferrite-app" | grep mlx)"
ldd "$unpacked/usr/lib/ferrite/mlx/lib/libmlx.so" | grep -q "libblas-bd8a282c.so.3.10.0 => $unpacked/usr/lib/ferrite/" \
  || fail "the packaged libmlx.so does not load the packaged BLAS"
ldd "$unpacked/usr/lib/ferrite/mlx/lib/libmlx.so" | grep -q 'not found' && fail "unresolved libraries: $(ldd "$unpacked/usr/lib/ferrite/mlx/lib/libmlx.so" | grep 'not found')"
echo "bundle check: $(basename "$deb") ($(du -h "$deb" | cut -f1)) has the app, its libraries, icons, desktop entry and the embedded model"
