#!/usr/bin/env bash
# Twenty-seventh sitting, v49 (products of up to 192 tokens on wide tiles of 64, 128 and 192 tokens):
# the quant kernel tests (every wide width), then the random Qwen2.5-7B as Q4_K_M at 32, 64 and 256
# users (512 tokens in, 128 out), v49 against the same build with STRATA_QUANT_WIDE_NARROW=0
# (qgemm and the 256-token tiles, as main at 5b1df99) and =128 (no 192-token tiles, 256 users),
# alternated, bf16 between; then eager profiles at 32 users of both, if time is left.
# Carries strata.gz, cuda-kernels-test.gz, tokenizers-qwen2.5.tgz and llama-src.tar.xz.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call22
pack_every 10
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
(qwen7b_checkpoint; qwen7b_q4_k_m) > "$OUT/prepare.log" 2>&1 &
PREP=$!
echo "== kernel tests (t=$SECONDS)"
timeout 200 gpu-bin/cuda-kernels-test --skip compile:: --test-threads 1 quant:: > "$OUT/kernels.log" 2>&1
grep -hE "^test |panicked|test result|skipped" "$OUT/kernels.log" | cut -c1-300
wait $PREP; tail -1 "$OUT/prepare.log"
bench() {  # name STRATA_QUANT_WIDE_NARROW model levels
    [ $SECONDS -lt 480 ] || { echo "-- $1 skipped (t=$SECONDS)"; return; }
    STRATA_QUANT_WIDE_NARROW=$2 timeout 110 $S bench-gpu --model $3 --levels $4 --kv-cache-dtypes auto \
        --prompt-tokens 512 --output-tokens 128 --out "$OUT/bench_$1.json" 2>&1 |
        grep -v "outside the vocabulary" > "$OUT/bench_$1.log"
    echo "-- $1 (t=$SECONDS)"; grep -E "decode-only" "$OUT/bench_$1.log" | cut -c1-200
}
echo "== benches (t=$SECONDS)"
bench v49_a 192 $Q4KM 32,64,256
bench qgemm_a 0 $Q4KM 32,64,256
bench bf16 0 $Q7 32,64,256
bench narrow128 128 $Q4KM 256
bench v49_b 192 $Q4KM 32,64,256
bench qgemm_b 0 $Q4KM 32,64
profile() {  # name narrow
    [ $SECONDS -lt 480 ] || { echo "-- profile $1 skipped (t=$SECONDS)"; return; }
    STRATA_GPU_PROFILE=1 STRATA_QUANT_WIDE_NARROW=$2 timeout 50 $S bench-gpu --model $Q4KM --enforce-eager \
        --levels 32 --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 64 2>&1 |
        grep -v "outside the vocabulary" > "$OUT/profile_$1_32.log"
    echo "-- profile $1 (t=$SECONDS)"; grep -E "qgemm|gemm " "$OUT/profile_$1_32.log" | grep decode | head -12 | cut -c1-110
}
profile v49 192
profile qgemm 0
echo "end t=$SECONDS"
packer_stop
