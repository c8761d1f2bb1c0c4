#!/usr/bin/env bash
# Twenty-ninth sitting, v53: the wide tiles' per-lane offsets worked out once before the k loop,
# and each of a quant block's four steps compiled for its place in the block (splits are whole
# blocks), ~20 % fewer instructions a step. The quant kernel tests, then the random Qwen2.5-7B as
# Q4_K_M at 256 users (512 tokens in, 128 out), v53 against main's build (gpu-bin/v49/strata.gz,
# e230765) alternated, bf16 between; then 32 and 64 users while time is left (LIMIT=N, default
# 400: no bench starts past N s). Carries strata.gz, v49/strata.gz, cuda-kernels-test.gz,
# tokenizers-qwen2.5.tgz, llama-src.tar.xz.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call28
pack_every 10
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
(qwen7b_checkpoint; qwen7b_q4_k_m) > "$OUT/prepare.log" 2>&1 &
PREP=$!
echo "== kernel tests (t=$SECONDS)"
timeout 150 gpu-bin/cuda-kernels-test --skip compile:: --test-threads 1 quant:: > "$OUT/kernels.log" 2>&1
grep -hE "^test |panicked|test result|skipped" "$OUT/kernels.log" | cut -c1-300
wait $PREP; tail -1 "$OUT/prepare.log"
bench() {  # name binary model levels
    [ $SECONDS -lt ${LIMIT:-400} ] || { echo "-- $1 skipped (t=$SECONDS)"; return; }
    timeout 100 $2 bench-gpu --model $3 --levels $4 --kv-cache-dtypes auto \
        --prompt-tokens 512 --output-tokens 128 --out "$OUT/bench_$1.json" 2>&1 |
        grep -v "outside the vocabulary" > "$OUT/bench_$1.log"
    echo "-- $1 (t=$SECONDS)"; grep -E "decode-only" "$OUT/bench_$1.log" | cut -c1-170
}
echo "== benches (t=$SECONDS)"
bench v53_a $S $Q4KM 256
bench v49_a gpu-bin/v49/strata $Q4KM 256
bench bf16 $S $Q7 256
bench v49_b gpu-bin/v49/strata $Q4KM 256
bench v53_b $S $Q4KM 256
bench v53_small $S $Q4KM 32,64
bench v49_small gpu-bin/v49/strata $Q4KM 32,64
echo "end t=$SECONDS"
packer_stop
