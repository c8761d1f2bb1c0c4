#!/usr/bin/env bash
# Twenty-fifth sitting, v46 on a fresh machine: the wide pair's kernel test (and rope.cu's split
# sums again), then 256 users (512 tokens in, 128 out) of the random Qwen2.5-7B as Q4_K_M with
# pairs (STRATA_QUANT_WIDE_PAIRS=1), without (=0, the default), then bf16. Carries strata.gz,
# cuda-kernels-test.gz, tokenizers-qwen2.5.tgz and llama-src.tar.xz.
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
echo "end t=$SECONDS"
packer_stop
