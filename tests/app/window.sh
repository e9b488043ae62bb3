#!/usr/bin/env bash
# The real app under Xvfb: it starts on the embedded default model, shows its window and its
# tray icon (in trayer, a system tray host), serves the API, shows its window when launched
# again, and quits cleanly from its tray menu and on SIGTERM; a launch where nothing can start
# shows a dialog.
# Screenshots for a person to look at: target/app-screenshots/{window,tray,menu,cannot-start}.png.
#
#   tests/app/window.sh [path/to/ferrite-app]      (default: target/debug/ferrite-app)
# Needs xvfb, trayer, imagemagick, x11-utils, xdotool (scripts/setup.sh --tests installs them).
set -euo pipefail
cd "$(dirname "$0")/../.."
APP=${APP:-${1:-target/debug/ferrite-app}}
OUT=target/app-screenshots
mkdir -p "$OUT"
for tool in xvfb-run trayer import xwininfo xdotool; do
  command -v "$tool" >/dev/null || { echo "window test skipped: $tool is not installed (scripts/setup.sh --tests)"; exit 0; }
done
[ -x "$APP" ] || { echo "no app binary at $APP: cargo build -p ferrite-app" >&2; exit 1; }
if [ "${1:-}" = --inside ]; then INSIDE=1; fi
port=${port:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

inner() {
  set -euo pipefail
  trayer --edge top --align right --widthtype request --height 32 --SetDockType true --transparent false --tint 0xdddddd &
  sleep 1
  FERRITE_PORT=$port FERRITE_CONFIG_DIR=$config RUST_LOG=info "$APP" > "$OUT/app.log" 2>&1 &
  app=$!
  for _ in $(seq 120); do
    curl -fs "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 $app 2>/dev/null || { echo "the app exited early:"; cat "$OUT/app.log"; return 1; }
    sleep 0.5
  done
  curl -fs "http://127.0.0.1:$port/v1/models" | grep -q ferrite-code-20m || { echo "the app does not serve the default model"; return 1; }
  # The model remembered from the last launch (written below, before this one) cannot start:
  # the app runs the default instead and its window says why.
  curl -fs "http://127.0.0.1:$port/v1/status" | grep -q '"notice":"Ferrite could not start `gone-model`' \
    || { echo "no notice about the remembered model that cannot start:"; curl -s "http://127.0.0.1:$port/v1/status"; return 1; }
  # The window, titled Ferrite, and the page inside it talking to the server.
  # Up to 90 s: a loaded machine is slow to map it. One search can fail on its own when
  # another window (the desktop portal's) vanishes mid-search (X BadWindow), so the verdict
  # is the loop's, not a last single search's.
  found=
  for _ in $(seq 180); do xdotool search --name '^Ferrite$' >/dev/null 2>&1 && { found=1; break; }; sleep 0.5; done
  [ -n "$found" ] || { echo "no window titled Ferrite"; xwininfo -root -tree | head -40; return 1; }
  sleep 4
  import -window root "$OUT/window.png"
  # Launched again, Ferrite shows the running app's window: the second process loads no model,
  # serves nothing and ends.
  FERRITE_PORT=$((port + 1)) FERRITE_CONFIG_DIR=$config RUST_LOG=info timeout 60 "$APP" > "$OUT/second.log" 2>&1 \
    || { echo "the second launch failed or hung:"; cat "$OUT/second.log"; return 1; }
  if grep -q "serving\|loaded" "$OUT/second.log"; then echo "the second launch started a server:"; cat "$OUT/second.log"; return 1; fi
  for _ in $(seq 20); do grep -q "launched again" "$OUT/app.log" && break; sleep 0.5; done
  grep -q "launched again" "$OUT/app.log" || { echo "the running app was not told of the second launch"; tail -5 "$OUT/app.log"; return 1; }
  # A model started from the window (or tray) is remembered for the next launch. Starting one
  # needs this launch's control token, which the page the server serves carries.
  token=$(curl -fs "http://127.0.0.1:$port/" | sed -n 's/.*name="ferrite-token" content="\([0-9a-f]*\)".*/\1/p')
  [ ${#token} -eq 64 ] || { echo "the page carries no control token"; return 1; }
  curl -s -X POST "http://127.0.0.1:$port/v1/models/load" -H 'content-type: application/json' -d '{"model": "default"}' \
    | grep -q "x-ferrite-token" || { echo "a model was started without the control token"; return 1; }
  curl -fs -X POST "http://127.0.0.1:$port/v1/models/load" -H 'content-type: application/json' \
    -H "x-ferrite-token: $token" -d '{"model": "default"}' >/dev/null \
    || { echo "starting the default model from the API failed"; return 1; }
  grep -q '^model = "default"' "$config/config.toml" || { echo "the started model was not remembered:"; cat "$config/config.toml"; return 1; }
  # The tray icon: trayer embeds it as a child window of its panel.
  # trayer's panel: its largest mapped window (it also owns small hidden ones).
  tray=$(for w in $(xdotool search --onlyvisible --class trayer); do xwininfo -id "$w" | awk -v w="$w" '/Width/{a=$2} /Height/{b=$2} END{print a*b, w}'; done | sort -n | tail -1 | cut -d' ' -f2)
  icons=$(xwininfo -id "$tray" -children | grep -c 'child\|0x' || true)
  geometry=$(xwininfo -id "$tray" | awk '/Absolute upper-left X/{x=$4} /Absolute upper-left Y/{y=$4} /Width/{w=$2} /Height/{h=$2} END{print w"x"h"+"x"+"y}')
  import -window root -crop "$geometry" "$OUT/tray.png"
  [ "$icons" -gt 1 ] || { echo "no icon in the tray"; xwininfo -id "$tray" -tree; return 1; }
  # Open the tray menu, photograph it, and choose Quit: the app must stop the engine and exit.
  eval "$(xwininfo -id "$tray" | awk '/Absolute upper-left X/{print "tx="$4} /Absolute upper-left Y/{print "ty="$4} /Width/{print "tw="$2} /Height/{print "th="$2}')"
  echo "tray panel at ${tx},${ty} size ${tw}x${th}"
  # The menu: a visible window of the app other than the main one (a right click opens it;
  # tried three times, as a loaded machine may drop the first click).
  find_menu() {
    for w in $(xdotool search --onlyvisible --pid $app 2>/dev/null); do
      xwininfo -id "$w" | awk -v w="$w" '/Width/{a=$2} /Height/{b=$2} END{if (a > 50 && b > 50 && b < 600) print a*b, w}'
    done | sort -n | head -1 | cut -d' ' -f2
  }
  menu=
  for _ in 1 2 3; do
    xdotool mousemove $((tx + tw - 16)) $((ty + th / 2)) click 3
    for _ in $(seq 10); do sleep 0.3; menu=$(find_menu); [ -n "$menu" ] && break; done
    [ -n "$menu" ] && break
  done
  [ -n "$menu" ] || { echo "the tray menu did not open"; return 1; }
  sleep 0.5
  import -window root "$OUT/menu.png"
  eval "$(xwininfo -id "$menu" | awk '/Absolute upper-left X/{print "mx="$4} /Absolute upper-left Y/{print "my="$4} /Width/{print "mw="$2} /Height/{print "mh="$2}')"
  echo "tray menu at ${mx},${my} size ${mw}x${mh}"
  xdotool mousemove $((mx + mw / 3)) $((my + mh - 14)) sleep 0.3 click 1
  for _ in $(seq 40); do kill -0 $app 2>/dev/null || break; sleep 0.5; done
  if kill -0 $app 2>/dev/null; then
    echo "the app is still running after Quit"; kill $app; tail -20 "$OUT/app.log"; return 1
  fi
  wait $app || { echo "the app exited with an error:"; tail -20 "$OUT/app.log"; return 1; }
  grep -q "server and engine stopped" "$OUT/app.log" || { echo "Quit did not stop the engine cleanly:"; tail -20 "$OUT/app.log"; return 1; }
  # When not even the default model can start, a dialog says why and the app exits (1) once
  # it is closed: no panic, no app without a server.
  FERRITE_ASSETS=/nonexistent FERRITE_MODEL=gone-model FERRITE_PORT=$port FERRITE_CONFIG_DIR=$config "$APP" > "$OUT/broken.log" 2>&1 &
  app=$!
  dialog=
  for _ in $(seq 120); do dialog=$(xdotool search --onlyvisible --name '^Ferrite could not start$' 2>/dev/null | head -1 || true); [ -n "$dialog" ] && break; sleep 0.5; done
  [ -n "$dialog" ] || { echo "no dialog when nothing can start:"; cat "$OUT/broken.log"; kill $app; return 1; }
  sleep 1
  import -window root "$OUT/cannot-start.png"
  eval "$(xwininfo -id "$dialog" | awk '/Absolute upper-left X/{print "dx="$4} /Absolute upper-left Y/{print "dy="$4} /Width/{print "dw="$2} /Height/{print "dh="$2}')"
  # Its OK button spans the bottom; tried three times, as a loaded machine may drop a click.
  for _ in 1 2 3; do
    xdotool mousemove $((dx + dw / 2)) $((dy + dh - 16)) sleep 0.3 click 1
    for _ in $(seq 20); do kill -0 $app 2>/dev/null || break; sleep 0.5; done
    kill -0 $app 2>/dev/null || break
  done
  kill -0 $app 2>/dev/null && { echo "the app did not exit when its dialog was closed"; kill $app; return 1; }
  code=0; wait $app || code=$?
  [ "$code" = 1 ] || { echo "the app exited with $code, not 1, when nothing could start:"; cat "$OUT/broken.log"; return 1; }
  grep -q "ferrite-app: .*gone-model.*default.* is not usable" "$OUT/broken.log" || { echo "stderr does not say why:"; cat "$OUT/broken.log"; return 1; }
  if grep -q "panicked" "$OUT/broken.log"; then echo "the app panicked:"; cat "$OUT/broken.log"; return 1; fi
  # SIGTERM (a logout, `kill`) quits as the menu's Quit does: engine stopped, exit 0.
  FERRITE_APP_HIDDEN=1 FERRITE_PORT=$port FERRITE_CONFIG_DIR=$config RUST_LOG=info "$APP" > "$OUT/term.log" 2>&1 &
  app=$!
  for _ in $(seq 120); do curl -fs "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
  curl -fs "http://127.0.0.1:$port/health" >/dev/null || { echo "the app did not come up again:"; cat "$OUT/term.log"; kill $app; return 1; }
  kill -TERM $app
  for _ in $(seq 40); do kill -0 $app 2>/dev/null || break; sleep 0.5; done
  kill -0 $app 2>/dev/null && { echo "the app is still running 20 s after SIGTERM"; kill -9 $app; tail -20 "$OUT/term.log"; return 1; }
  wait $app || { echo "the app exited with an error after SIGTERM:"; tail -20 "$OUT/term.log"; return 1; }
  grep -q "server and engine stopped" "$OUT/term.log" || { echo "SIGTERM did not stop the engine cleanly:"; tail -20 "$OUT/term.log"; return 1; }
  echo "window, tray, second launch, Quit, a launch that cannot start and SIGTERM: ok (screenshots in $OUT)"
}
if [ -n "${INSIDE:-}" ]; then
  inner
  exit
fi
config=$(mktemp -d)
trap 'rm -rf "$config"' EXIT
printf '[app]\nmodel = "gone-model"\n' > "$config/config.toml"
export port config APP OUT
# A display and a session bus of our own; the script runs again inside them.
xvfb-run -a -s "-screen 0 1280x860x24" dbus-run-session -- "$0" --inside 2> >(grep -v "Failed to set fd limit" >&2)
