#!/usr/bin/env bash
# Twenty-sixth sitting, v48 (qgemm's sums staged in shared memory, as v47's wide tiles): the
# quant kernel tests, then 32 and 64 users (512 tokens in, 128 out; decode steps of 9-127 tokens
# run qgemm) of the random Qwen2.5-7B as Q4_K_M, this build against v47's (gpu-bin/main,
# ce44da4), alternated. Carries strata.gz, main/strata.gz, cuda-kernels-test.gz,
# tokenizers-qwen2.5.tgz and llama-src.tar.xz.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call20
pack_every 10
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
(qwen7b_checkpoint; qwen7b_q4_k_m) > "$OUT/prepare.log" 2>&1 &
PREP=$!
echo "== kernel tests (t=$SECONDS)"
timeout 170 gpu-bin/cuda-kernels-test --skip compile:: --test-threads 1 quant:: > "$OUT/kernels.log" 2>&1
grep -hE "^test |panicked|test result|skipped" "$OUT/kernels.log" | cut -c1-300
wait $PREP; tail -1 "$OUT/prepare.log"
bench() {  # name binary
    timeout 100 $2 bench-gpu --model $Q4KM --levels 32,64 --kv-cache-dtypes auto --prompt-tokens 512 \
        --output-tokens 128 --out "$OUT/bench_$1.json" > "$OUT/bench_$1.log" 2>&1
    echo "-- $1 (t=$SECONDS)"; grep -E "decode-only" "$OUT/bench_$1.log" | cut -c1-200
}
echo "== benches (t=$SECONDS)"
bench v48_a $S
bench v47_a gpu-bin/main/strata
bench v48_b $S
bench v47_b gpu-bin/main/strata
echo "end t=$SECONDS"
packer_stop
