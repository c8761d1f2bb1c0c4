#!/usr/bin/env bash
# Twenty-first sitting, first call: the tail pieces' kernel test, an eager 256-user profile with
# them on, the two settings timed, and ncu's per-instruction stall samples of the wide tiles.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call3
pack_every 15
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
echo "== quantized_gemm kernel test (t=$SECONDS)"
timeout 120 gpu-bin/cuda-kernels-test --skip compile:: --nocapture --test-threads 1 quantized norms_sum > "$OUT/kernels_quantized.log" 2>&1
grep -hE "^test |panicked|test result" "$OUT/kernels_quantized.log" | head -30
echo "== checkpoint and Q4_K_M (t=$SECONDS)"
qwen7b_checkpoint
qwen7b_q4_k_m
F=$Q4KM
eager() {  # name env...
    local name=$1; shift
    echo "== eager 256-user profile, $name (t=$SECONDS)"
    env "$@" STRATA_GPU_PROFILE=1 timeout 90 $S bench-gpu --model $F --enforce-eager --levels 256 --kv-cache-dtypes auto \
        --prompt-tokens 512 --output-tokens 32 --decode-tokens 32 --out "$OUT/profile_${name}_256.json" \
        > "$OUT/profile_${name}_256.log" 2>&1
    grep -A40 "GPU profile" "$OUT/profile_${name}_256.log" | cut -c1-110
}
bench() {  # name model env...
    local name=$1 m=$2; shift 2
    echo "-- $name (t=$SECONDS)"
    env "$@" timeout 130 $S bench-gpu --model $m --levels 256 --kv-cache-dtypes auto --prompt-tokens 512 \
        --output-tokens 128 --out "$OUT/bench_$name.json" > "$OUT/bench_$name.log" 2>&1
    grep -E "^single stream|^\| bf16 " "$OUT/bench_$name.log" | cut -c1-200
}
bench q4_k_m_default $F X=1
bench q4_k_m_tail1 $F STRATA_QUANT_WIDE_TAIL=1
bench q4_k_m_fold0 $F STRATA_FOLD_SPLIT_SUMS=0
bench bf16 $Q7 X=1
eager tail STRATA_QUANT_WIDE_TAIL=1
echo "end t=$SECONDS"
packer_stop
