#!/usr/bin/env bash
# Thirtieth sitting, v54's probe: where a 256-token wide step's time goes. The quant kernel tests
# on main's build while the random Qwen2.5-7B and its Q4_K_M (strata quantize) are made; then the
# eager per-kernel profile at 256 users (512 tokens in, 32 out) with the wide tiles as built
# (QWIDE_PROBE=0), without their fragments' decode (1), without it and with A from shared memory
# (3: wgmma's SS form), without their products (2), then 0 again. Probes 1-3 give wrong sums:
# only their kernels' times count. LIMIT=N (default 400):
# no profile starts past N s. Carries strata.gz, cuda-kernels-test.gz, tokenizers-qwen2.5.tgz,
# llama-src.tar.xz.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call30
pack_every 10
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
(qwen7b_checkpoint; qwen7b_q4_k_m) > "$OUT/prepare.log" 2>&1 &
PREP=$!
echo "== kernel tests (t=$SECONDS)"
timeout 150 gpu-bin/cuda-kernels-test --skip compile:: --test-threads 1 quant:: > "$OUT/kernels.log" 2>&1
grep -hE "^test |panicked|test result|skipped" "$OUT/kernels.log" | cut -c1-300
wait $PREP; tail -1 "$OUT/prepare.log"
profile() {  # name probe
    [ $SECONDS -lt ${LIMIT:-400} ] || { echo "-- $1 skipped (t=$SECONDS)"; return; }
    STRATA_KERNEL_DEFINES=QWIDE_PROBE=$2 STRATA_GPU_PROFILE=1 timeout 150 $S bench-gpu --model $Q4KM --enforce-eager \
        --levels 256 --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 32 --decode-tokens 32 \
        --out "$OUT/profile_$1.json" 2>&1 | grep -v "outside the vocabulary" > "$OUT/profile_$1.log"
    echo "-- $1: QWIDE_PROBE=$2 (t=$SECONDS)"
    grep -E "qgemm_wide.*x2[0-9][0-9]\)" "$OUT/profile_$1.log" | sort -k2,2 | head -16 | cut -c1-110
}
echo "== profiles (t=$SECONDS)"
profile built_a 0
profile no_decode 1
profile smem_a 3
profile no_products 2
profile built_b 0
echo "end t=$SECONDS"
packer_stop
