#!/usr/bin/env bash
# Twenty-seventh sitting, v50 (the wide tiles' stages as many as their shared memory holds: the
# copies 5 steps ahead for the 64-token Q4_K tiles, 6 for the 128-token ones, where all were 2):
# the quant kernel tests, then the random Qwen2.5-7B as Q4_K_M at 32, 64 and 256 users (512 tokens
# in, 128 out), this build against v49's, alternated, bf16 between. Written in the twenty-seventh
# sitting, run in the twenty-eighth: gpu-bin from branch v50-wide-stages (64ac8b7),
# gpu-bin/v49/strata.gz from e09e4ae.
# Carries strata.gz, v49/strata.gz, cuda-kernels-test.gz, tokenizers-qwen2.5.tgz, llama-src.tar.xz.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call23
pack_every 10
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
(qwen7b_checkpoint; qwen7b_q4_k_m) > "$OUT/prepare.log" 2>&1 &
PREP=$!
echo "== kernel tests (t=$SECONDS)"
timeout 200 gpu-bin/cuda-kernels-test --skip compile:: --test-threads 1 quant:: > "$OUT/kernels.log" 2>&1
grep -hE "^test |panicked|test result|skipped" "$OUT/kernels.log" | cut -c1-300
wait $PREP; tail -1 "$OUT/prepare.log"
bench() {  # name binary model levels
    [ $SECONDS -lt 450 ] || { echo "-- $1 skipped (t=$SECONDS)"; return; }
    timeout 110 $2 bench-gpu --model $3 --levels $4 --kv-cache-dtypes auto \
        --prompt-tokens 512 --output-tokens 128 --out "$OUT/bench_$1.json" 2>&1 |
        grep -v "outside the vocabulary" > "$OUT/bench_$1.log"
    echo "-- $1 (t=$SECONDS)"; grep -E "decode-only" "$OUT/bench_$1.log" | cut -c1-200
}
echo "== benches (t=$SECONDS)"
bench v50_a $S $Q4KM 32,64,256
bench v49_a gpu-bin/v49/strata $Q4KM 32,64,256
bench bf16 $S $Q7 32,64,256
bench v49_b gpu-bin/v49/strata $Q4KM 32,64,256
bench v50_b $S $Q4KM 32,64,256
echo "end t=$SECONDS"
packer_stop
