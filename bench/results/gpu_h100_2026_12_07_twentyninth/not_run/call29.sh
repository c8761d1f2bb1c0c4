#!/usr/bin/env bash
# Twenty-ninth sitting, for the next: v53 (branch v53-wide-phase, 3265580) under the quant kernel
# tests, then where its wide tiles wait: call25's ncu sampling on its build. v53 cut a fifth of the
# wide step's instructions and gained ~1 % (call28); if the tensor cores stay ~68 % busy, the
# register-sourced products of two warpgroups are the bound (bench/NOTES.md v53). Build gpu-bin
# from the branch first. Carries strata.gz, cuda-kernels-test.gz, tokenizers-qwen2.5.tgz,
# llama-src.tar.xz.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call29
pack_every 15
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
(qwen7b_checkpoint; qwen7b_q4_k_m) > "$OUT/prepare.log" 2>&1 &
PREP=$!
timeout 200 gpu-bin/cuda-kernels-test --skip compile:: --test-threads 1 quant:: > "$OUT/kernels.log" 2>&1
grep -hE "^test |panicked|test result" "$OUT/kernels.log" | cut -c1-300
wait $PREP; tail -1 "$OUT/prepare.log"
# call25's sampling, by ncu.sh (NCU_RUN=wide NCU_SASS=1): two launches each, from the same skips.
sample() {  # name kernel-regex skip
    [ $SECONDS -lt 420 ] || { echo "-- $1 skipped (t=$SECONDS)"; return; }
    echo "-- $1 (t=$SECONDS)"
    OUT=$OUT NCU_RUN=wide NCU_SASS=1 NCU_NAME=$1 NCU_KERNELS=$2 NCU_SKIP=$3 NCU_COUNT=2 NCU_TIMEOUT=150 \
        NCU_SUMMARY_LINES=8 bash scripts/gpu/ncu.sh
}
sample q4_k_256 'qgemm_wide_q4_k$' 300
sample q6_k_256 'qgemm_wide_q6_k$' 100
echo "end t=$SECONDS"
packer_stop
