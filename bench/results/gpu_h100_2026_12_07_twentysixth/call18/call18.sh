#!/usr/bin/env bash
# Twenty-sixth sitting, v46 on a fresh machine: the wide pair's kernel test (and rope.cu's split
# sums again), then 256 users (512 tokens in, 128 out) of the random Qwen2.5-7B as Q4_K_M with
# pairs (STRATA_QUANT_WIDE_PAIRS=1), without (=0, the default), bf16, the two again in reverse
# order, and ncu's durations of 16 wide products in eager decode steps with pairs (ncu.sh's
# quant run: products past 512 tokens dequantized, so the skip counts decode steps' launches).
# Carries strata.gz, cuda-kernels-test.gz, tokenizers-qwen2.5.tgz and llama-src.tar.xz.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call18
pack_every 10
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
(qwen7b_checkpoint; qwen7b_q4_k_m) > "$OUT/prepare.log" 2>&1 &
PREP=$!
echo "== kernel tests (t=$SECONDS)"
timeout 150 gpu-bin/cuda-kernels-test --skip compile:: --test-threads 1 a_wide_pair rope_sums \
    > "$OUT/kernels.log" 2>&1
grep -hE "^test |panicked|test result|skipped" "$OUT/kernels.log" | cut -c1-300
wait $PREP; tail -3 "$OUT/prepare.log"
bench() {  # name model env...
    local name=$1 m=$2; shift 2
    env "$@" timeout 100 $S bench-gpu --model $m --levels 256 --kv-cache-dtypes auto --prompt-tokens 512 \
        --output-tokens 128 --out "$OUT/bench_$name.json" > "$OUT/bench_$name.log" 2>&1
    echo "-- $name $* (t=$SECONDS)"; grep -E "decode-only" "$OUT/bench_$name.log" | cut -c1-220
}
echo "== benches (t=$SECONDS)"
bench q4_k_m_pairs_a $Q4KM STRATA_QUANT_WIDE_PAIRS=1
bench q4_k_m_alone_a $Q4KM STRATA_QUANT_WIDE_PAIRS=0
bench bf16 $Q7 X=1
bench q4_k_m_alone_b $Q4KM STRATA_QUANT_WIDE_PAIRS=0
bench q4_k_m_pairs_b $Q4KM STRATA_QUANT_WIDE_PAIRS=1
echo "== ncu: the wide products' own durations in eager decode steps, with pairs (t=$SECONDS)"
STRATA_QUANT_WIDE_PAIRS=1 NCU_RUN=quant NCU_NAME=wide NCU_KERNELS=qgemm_wide NCU_SKIP=3000 NCU_COUNT=16 \
    NCU_TIMEOUT=200 NCU_SUMMARY_LINES=400 bash scripts/gpu/ncu.sh | grep -E "qgemm_wide|Duration|Grid Size" | head -60
echo "end t=$SECONDS"
packer_stop
