#!/usr/bin/env bash
# Twenty-fourth sitting. `a`: pending-gpu-24's kernel tests (quantized_gemm default and under
# QWIDE_W_TMA=1, rope_sums), then 256 users: Q4_K_M default / STRATA_FOLD_SPLIT_SUMS=0 (v43's A/B)
# / QWIDE_W_TMA=1, bf16 with and without the prompt tiles. `b` (next call, warm machine): the
# default model staged from its parts, the long-prompt GPU test, then the A/Bs again.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
MODE=${1:-a}
start_results call11$MODE
pack_every 10
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
bash scripts/gpu/stage_model.sh | tee "$OUT/stage.log"
(qwen7b_checkpoint; qwen7b_q4_k_m) > "$OUT/prepare.log" 2>&1 &
PREP=$!
if [ $MODE = a ]; then
    echo "== kernel tests default (t=$SECONDS)"
    timeout 150 gpu-bin/cuda-kernels-test --skip compile:: --test-threads 1 quantized_gemm rope_sums \
        > "$OUT/kernels_default.log" 2>&1
    grep -hE "^test |panicked|test result" "$OUT/kernels_default.log" | cut -c1-300
    echo "== quantized_gemm QWIDE_W_TMA=1 (t=$SECONDS)"
    STRATA_KERNEL_DEFINES=QWIDE_W_TMA=1 timeout 100 gpu-bin/cuda-kernels-test --skip compile:: \
        --test-threads 1 quantized_gemm > "$OUT/kernels_w_tma.log" 2>&1
    grep -hE "^test |panicked|test result" "$OUT/kernels_w_tma.log" | cut -c1-300
else
    echo "== long-prompt GPU test (t=$SECONDS)"
    timeout 150 gpu-bin/cuda-test --test-threads 1 a_long_prompt > "$OUT/cuda_test_long_prompt.log" 2>&1
    grep -hE "^test |panicked|test result|max|top" "$OUT/cuda_test_long_prompt.log" | cut -c1-300
fi
wait $PREP; tail -3 "$OUT/prepare.log"
bench() {  # name model env...
    local name=$1 m=$2; shift 2
    env "$@" timeout 100 $S bench-gpu --model $m --levels 256 --kv-cache-dtypes auto --prompt-tokens 512 \
        --output-tokens 128 --out "$OUT/bench_$name.json" > "$OUT/bench_$name.log" 2>&1
    echo "-- $name $* (t=$SECONDS)"; grep -E "^single stream|^\| (bf16|fp8) " "$OUT/bench_$name.log" | cut -c1-220
}
echo "== benches (t=$SECONDS)"
bench q4_k_m_default_$MODE $Q4KM X=1
bench q4_k_m_fold0_$MODE $Q4KM STRATA_FOLD_SPLIT_SUMS=0
bench bf16_tiles_$MODE $Q7 X=1
bench bf16_per_token_$MODE $Q7 STRATA_PREFILL_ATTENTION=0
bench q4_k_m_w_tma_$MODE $Q4KM STRATA_KERNEL_DEFINES=QWIDE_W_TMA=1
echo "end t=$SECONDS"
packer_stop
