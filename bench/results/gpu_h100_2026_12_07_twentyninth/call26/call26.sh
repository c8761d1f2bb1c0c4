#!/usr/bin/env bash
# Twenty-eighth sitting, for the next: v52, the wide tiles without a block barrier a step
# (STRATA_KERNEL_DEFINES=QWIDE_DESYNC=1, opt-in on main): the quant kernel tests under the
# define, then the random Qwen2.5-7B as Q4_K_M at 32, 64 and 256 users (512 tokens in, 128 out),
# the define against the default of the same build, alternated, bf16 between; then both with
# every prompt chunk on the wide tiles (STRATA_QUANT_WIDE_MAX_TOKENS=4096) at 256 users, then
# main and bf16 with 8,192-token steps at 256 users. Build
# gpu-bin from main first; LIMIT=N (default 450) starts no bench past N s. Carries strata.gz,
# cuda-kernels-test.gz, tokenizers-qwen2.5.tgz, llama-src.tar.xz.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call26
pack_every 10
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
(qwen7b_checkpoint; qwen7b_q4_k_m) > "$OUT/prepare.log" 2>&1 &
PREP=$!
echo "== kernel tests under QWIDE_DESYNC=1 (t=$SECONDS)"
STRATA_KERNEL_DEFINES=QWIDE_DESYNC=1 timeout 200 gpu-bin/cuda-kernels-test --skip compile:: --test-threads 1 quant:: \
    > "$OUT/kernels.log" 2>&1
grep -hE "^test |panicked|test result|skipped" "$OUT/kernels.log" | cut -c1-300
wait $PREP; tail -1 "$OUT/prepare.log"
bench() {  # name defines model levels
    [ $SECONDS -lt ${LIMIT:-450} ] || { echo "-- $1 skipped (t=$SECONDS)"; return; }
    STRATA_KERNEL_DEFINES="$2" timeout 110 env ${ENVS:-} $S bench-gpu --model $3 --levels $4 --kv-cache-dtypes auto \
        --prompt-tokens 512 --output-tokens 128 ${ARGS:-} --out "$OUT/bench_$1.json" 2>&1 |
        grep -v "outside the vocabulary" > "$OUT/bench_$1.log"
    echo "-- $1 (t=$SECONDS)"; grep -E "decode-only" "$OUT/bench_$1.log" | cut -c1-200
}
echo "== benches (t=$SECONDS)"
bench v52_a QWIDE_DESYNC=1 $Q4KM 32,64,256
bench v49_a "" $Q4KM 32,64,256
bench bf16 "" $Q7 32,64,256
bench v49_b "" $Q4KM 32,64,256
bench v52_b QWIDE_DESYNC=1 $Q4KM 32,64,256
# Every prompt chunk on the wide tiles too (no dequantization for cuBLASLt), with and without.
ENVS=STRATA_QUANT_WIDE_MAX_TOKENS=4096 bench v52_wide4096 QWIDE_DESYNC=1 $Q4KM 256
ENVS=STRATA_QUANT_WIDE_MAX_TOKENS=4096 bench v49_wide4096 "" $Q4KM 256
# 8,192-token steps: half as many prompt chunks, so half the dequantization, for both.
ARGS="--max-num-batched-tokens 8192" bench v49_8192 "" $Q4KM 256
ARGS="--max-num-batched-tokens 8192" bench bf16_8192 "" $Q7 256
echo "end t=$SECONDS"
packer_stop
