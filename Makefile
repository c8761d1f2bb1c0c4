# strata: two commands on a fresh machine.
#   make serve   set up, fetch the default model, build, and run it
#   make test    set up, fetch fixtures, and pass every check (fmt, clippy, tests)

CARGO ?= cargo
STRATA := target/release/strata

.PHONY: setup fetch build serve test lint bench fidelity-reference quant-fixtures clean-cache

setup:
	@scripts/setup.sh

fetch: setup
	@python3 scripts/fetch.py all

build: setup
	$(CARGO) build --release --locked -p strata-cli

# Until the HTTP server lands, `serve` runs the default model on a chat prompt.
serve: fetch build
	$(STRATA) run --chat --prompt "$${PROMPT:-Write one sentence about the sea.}" --max-tokens $${MAX_TOKENS:-64}

lint: setup
	$(CARGO) fmt --all --check
	$(CARGO) clippy --locked --workspace --all-targets -- -D warnings

test: fetch lint
	$(CARGO) test --locked --workspace

bench: fetch build
	$(STRATA) bench-local --threads 2 --out bench/results/cpu_smollm2_q4_1.json

# Regenerate committed references (needs gguf==0.19.0 and numpy==2.4.6; see the scripts).
fidelity-reference: fetch
	python3 scripts/reference_smollm2.py

quant-fixtures:
	python3 scripts/make_quant_fixtures.py
