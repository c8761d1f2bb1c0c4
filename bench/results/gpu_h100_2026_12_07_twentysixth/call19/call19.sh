#!/usr/bin/env bash
# Twenty-sixth sitting, v47 (the wide tiles' sums staged in shared memory, pairs the default): the
# wide kernel tests, then 256 users (512 tokens in, 128 out) of the random Qwen2.5-7B as Q4_K_M:
# this build, main's (cb2af1d, gpu-bin/main) with STRATA_QUANT_WIDE_PAIRS=1, bf16, and the two
# again in reverse order. Carries strata.gz, main/strata.gz, cuda-kernels-test.gz,
# tokenizers-qwen2.5.tgz and llama-src.tar.xz.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call19
pack_every 10
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
(qwen7b_checkpoint; qwen7b_q4_k_m) > "$OUT/prepare.log" 2>&1 &
PREP=$!
echo "== kernel tests (t=$SECONDS)"
timeout 170 gpu-bin/cuda-kernels-test --skip compile:: --test-threads 1 a_wide_pair quantized_gemm_matches \
    > "$OUT/kernels.log" 2>&1
grep -hE "^test |panicked|test result|skipped" "$OUT/kernels.log" | cut -c1-300
wait $PREP; tail -2 "$OUT/prepare.log"
bench() {  # name binary model env...
    local name=$1 bin=$2 m=$3; shift 3
    env "$@" timeout 100 $bin bench-gpu --model $m --levels 256 --kv-cache-dtypes auto --prompt-tokens 512 \
        --output-tokens 128 --out "$OUT/bench_$name.json" > "$OUT/bench_$name.log" 2>&1
    echo "-- $name $* (t=$SECONDS)"; grep -E "decode-only" "$OUT/bench_$name.log" | cut -c1-220
}
echo "== benches (t=$SECONDS)"
bench v47_a $S $Q4KM X=1
bench main_pairs_a gpu-bin/main/strata $Q4KM STRATA_QUANT_WIDE_PAIRS=1
bench bf16 $S $Q7 X=1
bench main_pairs_b gpu-bin/main/strata $Q4KM STRATA_QUANT_WIDE_PAIRS=1
bench v47_b $S $Q4KM X=1
echo "end t=$SECONDS"
packer_stop
