#!/usr/bin/env bash
# Twenty-fourth sitting, fourth call: FP8 o and down GEMVs in blocks of 4 rows (gpu-bin/strata)
# against the pairs (gpu-bin/v42/strata, main before it): fp8.cu's kernel tests, then the 7B as
# FP8 (--quantization fp8) at one stream, alternated, and at 256 users beside bf16 (issue 30's
# FP8 bars). The x1 hashes must match: a row's sums are the same additions in the same order.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call13
pack_every 10
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
qwen7b_checkpoint > "$OUT/prepare.log" 2>&1 &
PREP=$!
echo "== kernel tests fp8 (t=$SECONDS)"
timeout 120 gpu-bin/cuda-kernels-test --skip compile:: --test-threads 1 fp8 > "$OUT/kernels_fp8.log" 2>&1
grep -hE "^test |panicked|test result" "$OUT/kernels_fp8.log" | cut -c1-300
wait $PREP; tail -1 "$OUT/prepare.log"
bench() {  # name binary quantization levels
    local name=$1 bin=$2 q=$3 levels=$4
    timeout 200 $bin bench-gpu --model $Q7 --quantization $q --levels $levels --kv-cache-dtypes auto \
        --prompt-tokens 512 --output-tokens 128 --out "$OUT/bench_$name.json" > "$OUT/bench_$name.log" 2>&1
    echo "-- $name (t=$SECONDS)"; grep -E "^single stream|^\| (bf16|fp8) " "$OUT/bench_$name.log" | cut -c1-220
    grep -o "x[0-9]* (0 constrained).*fnv1a [0-9a-f]*" "$OUT/bench_$name.log" | sed 's/ (0 constrained).*fnv1a/ fnv1a/'
}
echo "== benches (t=$SECONDS)"
bench fp8_rows4_a gpu-bin/strata fp8 1,256
bench fp8_pairs_a gpu-bin/v42/strata fp8 1
bench bf16 gpu-bin/strata none 256
bench fp8_rows4_b gpu-bin/strata fp8 1
bench fp8_pairs_b gpu-bin/v42/strata fp8 1
echo "end t=$SECONDS"
packer_stop
