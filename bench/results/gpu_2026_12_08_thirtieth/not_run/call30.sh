#!/usr/bin/env bash
# Thirtieth sitting (not run: no GPU was lent), v54: where a 256-token wide step's time goes, and
# the 256-token wide tiles warp-specialized. The quant kernel tests on main's build and again with
# QWIDE_SS=1 while the random Qwen2.5-7B and its Q4_K_M (strata quantize) are made; then the eager
# per-kernel profile at 256 users with the wide tiles as built (QWIDE_PROBE=0), without their
# fragments' decode (1), without it and with A from shared memory (3: wgmma's SS form), without
# their products (2), warp-specialized (QWIDE_SS=1), then as built again. Probes 1-3 give wrong
# sums: only their kernels' times count. LIMIT (libs.sh, default 400 here). Carries strata.gz,
# cuda-kernels-test.gz, tokenizers-qwen2.5.tgz, llama-src.tar.xz.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
begin_call call30
(qwen7b_checkpoint; qwen7b_q4_k_m) > "$OUT/prepare.log" 2>&1 &
PREP=$!
for defines in "" QWIDE_SS=1; do
    echo "== kernel tests ${defines:-as built} (t=$SECONDS)"
    STRATA_KERNEL_DEFINES=$defines timeout 150 gpu-bin/cuda-kernels-test --skip compile:: --test-threads 1 quant:: \
        > "$OUT/kernels${defines:+_ss}.log" 2>&1
    grep -hE "^test |panicked|test result|skipped" "$OUT/kernels${defines:+_ss}.log" | cut -c1-300
done
wait $PREP; tail -1 "$OUT/prepare.log"
echo "== profiles (t=$SECONDS)"
profile_gpu built_a $Q4KM
profile_gpu no_decode $Q4KM STRATA_KERNEL_DEFINES=QWIDE_PROBE=1
profile_gpu smem_a $Q4KM STRATA_KERNEL_DEFINES=QWIDE_PROBE=3
profile_gpu no_products $Q4KM STRATA_KERNEL_DEFINES=QWIDE_PROBE=2
profile_gpu ss $Q4KM STRATA_KERNEL_DEFINES=QWIDE_SS=1
profile_gpu built_b $Q4KM
echo "end t=$SECONDS"
packer_stop
