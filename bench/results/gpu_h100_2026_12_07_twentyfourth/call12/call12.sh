#!/usr/bin/env bash
# Twenty-fourth sitting, third call: main with v42 the default. The quantized GEMM's kernel test,
# then 256 users (512 in, 128 out): Q4_K_M default, its prompt chunks on the wide tiles too
# (STRATA_QUANT_GEMM_MAX_TOKENS=2048 and 1024, not dequantized for cuBLASLt), bf16, FP8
# (--quantization fp8, single stream and 256), ncu of the FP8 o and down GEMVs, and the lanes' weight copies (QWIDE_W_TMA=0).
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call12
pack_every 10
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
(qwen7b_checkpoint; qwen7b_q4_k_m) > "$OUT/prepare.log" 2>&1 &
PREP=$!
echo "== kernel test (t=$SECONDS)"
timeout 100 gpu-bin/cuda-kernels-test --skip compile:: --test-threads 1 quantized_gemm > "$OUT/kernels_default.log" 2>&1
grep -hE "^test |panicked|test result" "$OUT/kernels_default.log" | cut -c1-300
wait $PREP; tail -2 "$OUT/prepare.log"
bench() {  # name model quantization levels env...
    local name=$1 m=$2 q=$3 levels=$4; shift 4
    env "$@" timeout 100 $S bench-gpu --model $m --quantization $q --levels $levels --kv-cache-dtypes auto \
        --prompt-tokens 512 --output-tokens 128 --out "$OUT/bench_$name.json" > "$OUT/bench_$name.log" 2>&1
    echo "-- $name $* (t=$SECONDS)"; grep -E "^single stream|^\| (bf16|fp8) " "$OUT/bench_$name.log" | cut -c1-220
}
echo "== benches (t=$SECONDS)"
bench q4_k_m_default $Q4KM auto 256 X=1
bench q4_k_m_gemm2048 $Q4KM auto 256 STRATA_QUANT_GEMM_MAX_TOKENS=2048
bench bf16 $Q7 none 256 X=1
bench fp8 $Q7 fp8 1,256 X=1
echo "== ncu: the FP8 o and down GEMVs of one stream (t=$SECONDS)"
OUT=$OUT NCU_RUN=fp8 NCU_KERNELS=fp8_gemv_residual NCU_COUNT=4 NCU_STALLS=1 NCU_TIMEOUT=150 \
    NCU_SUMMARY_LINES=200 bash scripts/gpu/ncu.sh | grep -E "fp8_gemv|Duration|DRAM Throughput|Registers|Achieved Occ|Grid Size" | head -40
bench q4_k_m_w_lanes $Q4KM auto 256 STRATA_KERNEL_DEFINES=QWIDE_W_TMA=0
bench q4_k_m_gemm1024 $Q4KM auto 256 STRATA_QUANT_GEMM_MAX_TOKENS=1024
bench q4_k_m_default2 $Q4KM auto 256 X=1
echo "end t=$SECONDS"
packer_stop
