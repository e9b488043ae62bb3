# The two commands of the quick start: `make run` and `make test`. Both set up on first use.
CARGO ?= cargo
# The model `make run` serves: the embedded default (assets/models), or any MODEL=id|dir.
MODEL ?= default
PORT ?= 8080
# MTP draft depth: `auto` is what `ferrite tune` stored for this machine (plain decoding until then).
DRAFT ?= auto

.PHONY: setup build run app serve test check-mac bundle bench clean

setup:
	@scripts/setup.sh

build: setup
	$(CARGO) build --release -p ferrite-cli

# With a display (or on a Mac), the menu-bar app on the embedded default model; without one,
# `ferrite serve` on 127.0.0.1:$(PORT) until Ctrl-C.
run:
	@if [ "$$(uname -s)" = Darwin ] || [ -n "$${DISPLAY:-}$${WAYLAND_DISPLAY:-}" ]; then $(MAKE) --no-print-directory app; \
	else echo "No display: serving without the app."; $(MAKE) --no-print-directory serve; fi

app:
	@scripts/setup.sh --app
	$(CARGO) build --release -p ferrite-app
	@echo "Ferrite is in the menu bar (tray); its window shows the API URLs. OpenAI API at http://127.0.0.1:$(PORT)/v1"
	FERRITE_MODEL=$(MODEL) FERRITE_PORT=$(PORT) target/release/ferrite-app

serve: build
	@echo "Serving Ferrite's default model: web UI at http://127.0.0.1:$(PORT)/, OpenAI API at /v1, Anthropic at /v1/messages"
	@echo "  try: curl -s http://127.0.0.1:$(PORT)/v1/chat/completions -H 'content-type: application/json' \\"
	@echo "         -d '{\"model\": \"default\", \"messages\": [{\"role\": \"user\", \"content\": \"Write a Python function that reverses a list.\"}], \"max_tokens\": 128}'"
	target/release/ferrite serve --model $(MODEL) --port $(PORT) --draft-depth $(DRAFT)

test:
	@scripts/setup.sh --tests
	$(CARGO) fmt --all --check
	python3 scripts/check_house.py
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	# What the server and app link, without the engine's developer tools (its `dev` feature).
	$(CARGO) clippy -p ferrite-engine -p ferrite-server -p ferrite-store --lib -- -D warnings
	CARGO=$(CARGO) scripts/check-mac/run.sh
	$(CARGO) test --workspace --all-targets
	$(CARGO) build -p ferrite-cli
	$(CARGO) build -p ferrite-store --example test_hub
	tests/app/window.sh
	scripts/bundle.sh --check
	third_party/venv/bin/python -m pytest tests/sdk tests/bench tests/train -q
	third_party/venv/bin/python -m pytest tests/agents -q -s
	@if [ -d tests/ui/node_modules/playwright-core ]; then cd tests/ui && node --test ui.test.mjs; \
	else echo "tests/ui skipped: no Node.js here (scripts/setup.sh --tests installs it on Debian)"; fi

# Every crate type-checked and linted for aarch64-apple-darwin, on any OS (scripts/check-mac/run.sh).
check-mac:
	@scripts/setup.sh --mac-check
	CARGO=$(CARGO) scripts/check-mac/run.sh

# The app packaged: Ferrite.app and a .dmg on a Mac, a .deb on Linux (scripts/bundle.sh).
bundle:
	@scripts/setup.sh --bundle
	scripts/bundle.sh

# Ferrite vs mlx-lm decode speed on the same checkpoints (see bench/README.md).
bench: build
	bench/decode.sh

clean:
	$(CARGO) clean
