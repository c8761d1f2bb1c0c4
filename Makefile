# strata: two commands on a fresh machine.
#   make serve   set up, fetch the default model, build, and serve it on http://127.0.0.1:8000
#   make test    set up, fetch fixtures, and pass every check (fmt, clippy, tests, real clients)

CARGO ?= cargo
STRATA := target/release/strata
# The pinned openai SDK that scripts/setup.sh installs for the real-client tests.
CLIENTS_PYTHON = $${STRATA_CACHE:-$$HOME/.cache/strata}/clients-venv/bin/python

.PHONY: setup fetch build serve test test-clients soak fuzz lint bench bench-peers fidelity-reference quant-fixtures quant-models gpu-bin gpu-bin-llama clean-cache

setup:
	@scripts/setup.sh

fetch: setup
	@python3 scripts/fetch.py all

build: setup
	$(CARGO) build --release --locked -p strata-cli

# The OpenAI-compatible server on the default model; more flags with SERVE_ARGS="--api-key ...".
serve: fetch build
	$(STRATA) serve --host 127.0.0.1 --port 8000 $(SERVE_ARGS)

lint: setup
	$(CARGO) fmt --all --check
	$(CARGO) clippy --locked --workspace --all-targets -- -D warnings

# `cargo test` leaves the binary its CLI tests ran at target/debug/strata; the real-client
# tests reuse it (a separate `cargo build` resolves features differently and recompiles).
# NVRTC from the fetched wheel compiles every CUDA kernel for sm_90, sm_86 and sm_80 and the fetched
# ptxas assembles the PTX (no GPU needed); GPU tests skip with a reason where there is no GPU.
NVRTC_LIB = $${STRATA_CACHE:-$$HOME/.cache/strata}/nvrtc/nvidia/cu13/lib
PTXAS = $${STRATA_CACHE:-$$HOME/.cache/strata}/ptxas/bin/ptxas

test: fetch lint
	LD_LIBRARY_PATH=$(NVRTC_LIB):$$LD_LIBRARY_PATH STRATA_REQUIRE_NVRTC=1 STRATA_PTXAS=$(PTXAS) $(CARGO) test --locked --workspace
	STRATA_BIN=target/debug/strata $(CLIENTS_PYTHON) tests/clients/real_clients.py
	STRATA_BIN=target/debug/strata $(CLIENTS_PYTHON) tests/deploy/check_deploy.py
	STRATA_BIN=target/debug/strata $(CLIENTS_PYTHON) tests/soak/soak.py --duration 40

# The fuzz targets (GGUF, safetensors, config.json, tokenizer.json, request bodies) for FUZZ_SECONDS each,
# all of a crate at once, from a fresh seed (`make test` runs a fixed few thousand cases); a failing
# input is shrunk and saved under $TMPDIR/strata-fuzz, to be added to tests/fuzz_regressions/.
FUZZ_SECONDS ?= 120
fuzz: fetch
	STRATA_FUZZ_SECONDS=$(FUZZ_SECONDS) $(CARGO) test --locked --release -p strata-formats -p strata-model --test fuzz -- --nocapture --test-threads 3
	STRATA_FUZZ_SECONDS=$(FUZZ_SECONDS) $(CARGO) test --locked --release -p strata-server --test fuzz_requests -- --nocapture

# The official openai SDK and a real nginx against the `strata serve` binary, alone.
test-clients: fetch
	$(CARGO) build --locked --profile test -p strata-cli
	STRATA_BIN=target/debug/strata $(CLIENTS_PYTHON) tests/clients/real_clients.py

# `strata serve` (the default model, CPU, a KV cache small enough to preempt) under mixed load for
# DURATION seconds, then checks: no 5xx, clean refusals, KV blocks back, preemptions, RSS growth.
DURATION ?= 300
soak: fetch build
	STRATA_BIN=$(STRATA) $(CLIENTS_PYTHON) tests/soak/soak.py --duration $(DURATION)

bench: fetch build
	$(STRATA) bench-local --threads 2 --out bench/results/cpu_smollm2_q4_1.json
	$(CARGO) bench --locked -p strata-engine --bench throughput -- --activation-precision high --out bench/results/engine_throughput_high.json
	$(CARGO) bench --locked -p strata-engine --bench throughput -- --activation-precision standard --out bench/results/engine_throughput_standard.json
	$(CARGO) bench --locked -p strata-engine --bench host_step -- --out bench/results/engine_host_step.json
	$(CARGO) bench --locked -p strata-engine --bench throughput -- --levels 16,64 --constrained 0.5 --out bench/results/engine_throughput_constrained.json

# strata against llama.cpp (pinned source, built once into the cache) on this CPU, interleaved:
# pp512/tg128 and HTTP at 1 and 32 users; ratios to bench/results/peers_cpu_avx512.json.
bench-peers: fetch build
	python3 scripts/bench_peers.py $(PEERS_ARGS)

# Regenerate committed references (needs gguf==0.19.0 and numpy==2.4.6; see the scripts).
fidelity-reference: fetch
	python3 scripts/reference_smollm2.py

# The K-quant fixtures come from ggml's reference quantizers: `make bench-peers` builds them once.
quant-fixtures:
	python3 scripts/make_quant_fixtures.py

# SmolLM2 re-quantized by `strata quantize` to Q4_0, Q8_0, Q4_K, Q5_K, Q6_K and Q4_K_M in
# $STRATA_CACHE/models/quant/ (the GPU correctness tests' files); existing files are kept.
# What the GPU scripts (scripts/gpu/) carry to the device machine, built here into gpu-bin/.
gpu-bin: setup
	scripts/gpu/build_bin.sh

# llama.cpp's CUDA binaries (sm_90) for the GPU scripts' side-by-side runs, built here from pinned
# CUDA 13 wheels and the pinned llama.cpp source (~35 min on 2 cores the first time).
gpu-bin-llama: setup
	scripts/gpu/build_llama_bin.sh

quant-models: fetch build
	STRATA_BIN=$(STRATA) scripts/make_quant_models.sh
