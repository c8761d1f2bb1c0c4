#!/usr/bin/env bash
# Thirtieth sitting (not run), v54 at 256 users and issue 30's bars: on the machine call30 left
# (its checkpoint and Q4_K_M reused), the 7B Q4_K_M at 256 users (512 tokens in, 128 out) as built
# and with the 256-token wide tiles warp-specialized (QWIDE_SS=1) alternated, bf16 between; then
# `quantized.sh decode` at 1 and 256 users (llama.cpp's pp512/tg128 beside strata's Q4_K_M, bf16
# and FP8) while the call's limit allows. Carries strata.gz, cuda-kernels-test.gz,
# tokenizers-qwen2.5.tgz, llama-src.tar.xz and llama-bin.tar.xz.part*.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
begin_call call31
(qwen7b_checkpoint; qwen7b_q4_k_m) > "$OUT/prepare.log" 2>&1
LIMIT=${LIMIT:-200}
bench_gpu built_a $S $Q4KM 256
bench_gpu ss_a $S $Q4KM 256 STRATA_KERNEL_DEFINES=QWIDE_SS=1
bench_gpu bf16 $S $Q7 256
bench_gpu ss_b $S $Q4KM 256 STRATA_KERNEL_DEFINES=QWIDE_SS=1
bench_gpu built_b $S $Q4KM 256
packer_stop
echo "== bars (t=$SECONDS)"
OUT=$FINAL_OUT LEVELS=1,256 KERNEL_TESTS=rope:: bash scripts/gpu/quantized.sh decode
