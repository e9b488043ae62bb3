# The two commands of the quick start: `make run` and `make test`. Both set up on first use.
CARGO ?= cargo
# The model `make run` serves: the embedded default (assets/models), or any MODEL=id|dir.
MODEL ?= default
PORT ?= 8080
# MTP draft depth: `auto` is what `ferrite tune` stored for this machine (plain decoding until then).
DRAFT ?= auto

.PHONY: setup build run test bench clean

setup:
	@scripts/setup.sh

build: setup
	$(CARGO) build --release -p ferrite-cli

# Until the app lands (it needs a display too), `run` serves the embedded default model on
# 127.0.0.1:$(PORT) until Ctrl-C.
run: build
	@echo "Serving Ferrite's default model: web UI at http://127.0.0.1:$(PORT)/, OpenAI API at /v1, Anthropic at /v1/messages"
	@echo "  try: curl -s http://127.0.0.1:$(PORT)/v1/chat/completions -H 'content-type: application/json' \\"
	@echo "         -d '{\"model\": \"default\", \"messages\": [{\"role\": \"user\", \"content\": \"Write a Python function that reverses a list.\"}], \"max_tokens\": 128}'"
	target/release/ferrite serve --model $(MODEL) --port $(PORT) --draft-depth $(DRAFT)

test:
	@scripts/setup.sh --tests
	$(CARGO) test --workspace --all-targets
	$(CARGO) build -p ferrite-cli
	third_party/venv/bin/python -m pytest tests/sdk -q
	@if [ -d tests/ui/node_modules/playwright-core ]; then cd tests/ui && node --test ui.test.mjs; \
	else echo "tests/ui skipped: no Node.js here (scripts/setup.sh --tests installs it on Debian)"; fi

# Ferrite vs mlx-lm decode speed on the same checkpoints (see bench/README.md).
bench: build
	bench/decode.sh

clean:
	$(CARGO) clean
