#!/usr/bin/env bash
# For the next sitting (not run): v48's A/B again with bf16 beside it (32 and 64 users, 512 tokens
# in, 128 out; this build against ce44da4's in gpu-bin/main, alternated), then every kernel's
# own duration (ncu.sh's NCU_DURATIONS) over eager 256-user Q4_K_M steps, past the prompts.
# Carries strata.gz, main/strata.gz (built at ce44da4), tokenizers-qwen2.5.tgz, llama-src.tar.xz.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call21
pack_every 10
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
(qwen7b_checkpoint; qwen7b_q4_k_m) > "$OUT/prepare.log" 2>&1
tail -1 "$OUT/prepare.log"
bench() {  # name binary model
    timeout 100 $2 bench-gpu --model $3 --levels 32,64 --kv-cache-dtypes auto --prompt-tokens 512 \
        --output-tokens 128 --out "$OUT/bench_$1.json" > "$OUT/bench_$1.log" 2>&1
    echo "-- $1 (t=$SECONDS)"; grep -E "decode-only" "$OUT/bench_$1.log" | cut -c1-200
}
echo "== benches (t=$SECONDS)"
bench v48_a $S $Q4KM
bench v47_a gpu-bin/main/strata $Q4KM
bench bf16 $S $Q7
bench v47_b gpu-bin/main/strata $Q4KM
bench v48_b $S $Q4KM
echo "== ncu: each launch's duration in eager 256-user steps (t=$SECONDS)"
NCU_RUN=quant NCU_NAME=step NCU_DURATIONS=1 NCU_KERNELS=. NCU_SKIP=15000 NCU_COUNT=4000 NCU_TIMEOUT=240 \
    NCU_SUMMARY_LINES=20 bash scripts/gpu/ncu.sh
echo "end t=$SECONDS"
packer_stop
