# The two commands of the quick start: `make run` and `make test`. Both set up on first use.
CARGO ?= cargo
DEMO_MODEL ?= target/ferrite-demo/qwen3-tiny-4bit

.PHONY: setup build run test bench clean

setup:
	@scripts/setup.sh

build: setup
	$(CARGO) build --release -p ferrite-cli

# Until the server and the app land, `run` generates text with a project-made checkpoint.
run: build
	@test -f $(DEMO_MODEL)/config.json || target/release/ferrite dev make-checkpoint \
		--arch qwen3 --preset tiny --bits 4 --group-size 32 --out $(DEMO_MODEL)
	target/release/ferrite generate --model $(DEMO_MODEL) --chat \
		--prompt "Write a function that adds two numbers." --max-tokens 64 --temp 0.7 --seed 1

test: setup
	$(CARGO) test --workspace --all-targets
	$(CARGO) build -p ferrite-cli
	third_party/venv/bin/python -m pytest tests/sdk -q

# Ferrite vs mlx-lm decode speed on the same checkpoints (see bench/README.md).
bench: build
	bench/decode.sh

clean:
	$(CARGO) clean
