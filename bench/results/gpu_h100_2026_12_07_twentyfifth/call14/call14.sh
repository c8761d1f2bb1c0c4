#!/usr/bin/env bash
# Twenty-fifth sitting, first call (a fresh machine): FP8 v10's kernel tests (rope, fp8), the
# quantized GEMMs' kernel test by default and under v45's QWIDE_DEEP=1, then 256 users (512
# tokens in, 128 out) of the random Qwen2.5-7B as Q4_K_M, default and deep alternated with bf16
# between, then an eager 256-user profile under the define. Carries strata.gz,
# cuda-kernels-test.gz, tokenizers-qwen2.5.tgz, llama-src.tar.xz and model.gz.partaa (staged for
# call 16).
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call14
pack_every 10
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
mkdir -p /root/keep && cp -f gpu-bin/strata /root/keep/strata
bash scripts/gpu/stage_model.sh | tee "$OUT/stage.log"
echo "== rope and fp8 kernel tests (FP8 v10) (t=$SECONDS)"
timeout 150 gpu-bin/cuda-kernels-test --skip compile:: --test-threads 1 rope fp8 > "$OUT/kernels_fp8_rope.log" 2>&1
grep -hE "^test |panicked|test result" "$OUT/kernels_fp8_rope.log" | cut -c1-300
(qwen7b_checkpoint; qwen7b_q4_k_m) > "$OUT/prepare.log" 2>&1 &
PREP=$!
echo "== quantized_gemm, default (t=$SECONDS)"
timeout 150 gpu-bin/cuda-kernels-test --skip compile:: --test-threads 1 quantized_gemm > "$OUT/kernels_default.log" 2>&1
grep -hE "^test |panicked|test result" "$OUT/kernels_default.log" | cut -c1-300
echo "== quantized_gemm, QWIDE_DEEP=1 (t=$SECONDS)"
STRATA_KERNEL_DEFINES=QWIDE_DEEP=1 timeout 150 gpu-bin/cuda-kernels-test --skip compile:: --test-threads 1 \
    quantized_gemm > "$OUT/kernels_deep.log" 2>&1
grep -hE "^test |panicked|test result" "$OUT/kernels_deep.log" | cut -c1-300
DEEP_OK=$(grep -c "test result: ok. [1-9]" "$OUT/kernels_deep.log")
wait $PREP; tail -3 "$OUT/prepare.log"
bench() {  # name model env...
    local name=$1 m=$2; shift 2
    env "$@" timeout 100 $S bench-gpu --model $m --levels 256 --kv-cache-dtypes auto --prompt-tokens 512 \
        --output-tokens 128 --out "$OUT/bench_$name.json" > "$OUT/bench_$name.log" 2>&1
    echo "-- $name $* (t=$SECONDS)"; grep -E "^\| (bf16|fp8) |decode-only|decode step" "$OUT/bench_$name.log" | cut -c1-220
}
echo "== benches (t=$SECONDS), deep kernel test ok: $DEEP_OK"
bench q4_k_m_default_a $Q4KM X=1
[ "$DEEP_OK" = 1 ] && bench q4_k_m_deep_a $Q4KM STRATA_KERNEL_DEFINES=QWIDE_DEEP=1
bench bf16 $Q7 X=1
[ "$DEEP_OK" = 1 ] && bench q4_k_m_deep_b $Q4KM STRATA_KERNEL_DEFINES=QWIDE_DEEP=1
bench q4_k_m_default_b $Q4KM X=1
if [ "$DEEP_OK" = 1 ]; then
    echo "== eager 256-user profile, QWIDE_DEEP=1 (t=$SECONDS)"
    STRATA_KERNEL_DEFINES=QWIDE_DEEP=1 STRATA_GPU_PROFILE=1 timeout 150 $S bench-gpu --model $Q4KM --enforce-eager \
        --levels 256 --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 32 --decode-tokens 32 \
        --out "$OUT/profile_deep_256.json" > "$OUT/profile_deep_256.log" 2>&1
    grep -E "qgemm_wide" "$OUT/profile_deep_256.log" | head -20
fi
echo "end t=$SECONDS"
packer_stop
