#!/usr/bin/env bash
# Twenty-ninth sitting: the prompt chunks' dequantization at 256 users (random Qwen2.5-7B as
# Q4_K_M, 512 tokens in, 128 out): 8,192-token steps for Q4_K_M and bf16 (half the chunks), and
# v51's slabs (STRATA_DEQUANT_SLAB_MIB=16) at 4,096 and 8,192, main's default between.
# Carries strata.gz, tokenizers-qwen2.5.tgz, llama-src.tar.xz. LIMIT=N starts no bench past N s.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call27
pack_every 10
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
(qwen7b_checkpoint; qwen7b_q4_k_m) > "$OUT/prepare.log" 2>&1
tail -1 "$OUT/prepare.log"
bench() {  # name slab_mib model [args]
    [ $SECONDS -lt ${LIMIT:-450} ] || { echo "-- $1 skipped (t=$SECONDS)"; return; }
    local name=$1 slab=$2 model=$3; shift 3
    STRATA_DEQUANT_SLAB_MIB=$slab timeout 100 $S bench-gpu --model $model --levels 256 --kv-cache-dtypes auto \
        --prompt-tokens 512 --output-tokens 128 --out "$OUT/bench_$name.json" "$@" 2>&1 |
        grep -v "outside the vocabulary" > "$OUT/bench_$name.log"
    echo "-- $name (t=$SECONDS)"; grep -E "decode-only" "$OUT/bench_$name.log" | cut -c1-170
}
echo "== benches (t=$SECONDS)"
bench q_4096_a 0 $Q4KM
bench q_8192_a 0 $Q4KM --max-num-batched-tokens 8192
bench bf16_4096 0 $Q7
bench bf16_8192 0 $Q7 --max-num-batched-tokens 8192
bench q_slab16_4096 16 $Q4KM
bench q_slab16_8192 16 $Q4KM --max-num-batched-tokens 8192
bench q_8192_b 0 $Q4KM --max-num-batched-tokens 8192
bench q_4096_b 0 $Q4KM
bench q_slab8_4096 8 $Q4KM
bench q_slab32_4096 32 $Q4KM
echo "end t=$SECONDS"
packer_stop
