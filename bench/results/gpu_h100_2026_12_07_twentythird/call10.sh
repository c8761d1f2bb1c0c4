#!/usr/bin/env bash
# Twenty-third sitting, the short form: the new kernel tests, then bf16 with and without the
# prompt tiles (256 users; one 4,096-token prompt over a bf16 and an fp8 cache).
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call10
pack_every 10
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
qwen7b_checkpoint > "$OUT/prepare.log" 2>&1 &
PREP=$!
echo "== kernel tests (t=$SECONDS)"
timeout 90 gpu-bin/cuda-kernels-test --skip compile:: --test-threads 1 prompt_tiles rope_sums \
    > "$OUT/kernels_default.log" 2>&1
grep -hE "^test |panicked|test result" "$OUT/kernels_default.log" | cut -c1-300
wait $PREP
bench() {  # name levels prompt output env...
    local name=$1 levels=$2 prompt=$3 output=$4; shift 4
    env "$@" timeout 70 $S bench-gpu --model $Q7 --levels $levels --kv-cache-dtypes ${KV:-auto} --prompt-tokens $prompt \
        --output-tokens $output --out "$OUT/bench_$name.json" > "$OUT/bench_$name.log" 2>&1
    echo "-- $name ${KV:-auto} $* (t=$SECONDS)"; grep -E "^single stream|^\| (bf16|fp8) " "$OUT/bench_$name.log" | cut -c1-220
}
bench bf16_4k_tiles 1 4096 16 X=1
bench bf16_4k_per_token 1 4096 16 STRATA_PREFILL_ATTENTION=0
KV=fp8 bench fp8_cache_4k_tiles 1 4096 16 X=1
KV=fp8 bench fp8_cache_4k_per_token 1 4096 16 STRATA_PREFILL_ATTENTION=0
bench bf16_256_tiles 256 512 128 X=1
bench bf16_256_per_token 256 512 128 STRATA_PREFILL_ATTENTION=0
echo "end t=$SECONDS"
packer_stop
