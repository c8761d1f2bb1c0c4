#!/usr/bin/env bash
# Twenty-eighth sitting, v51: prompt chunks past the wide tiles (over 1,024 tokens) dequantize a
# quantized matrix for cuBLASLt; STRATA_DEQUANT_SLAB_MIB=N does it N MiB of bf16 rows at a time,
# each slab multiplied while the L2 holds it. The random Qwen2.5-7B as Q4_K_M at 256 users (512
# tokens in, 128 out; 4,096-token steps), the default against slabs of 8, 16 and 32 MiB, bf16
# between; then every prompt chunk on the wide tiles (STRATA_QUANT_WIDE_MAX_TOKENS=4096), both
# at 8,192-token steps, and an eager profile at 256 users with 16 MiB slabs.
# Not run in the twenty-eighth sitting (machines were paused): build gpu-bin from branch
# v51-dequant-slabs (eb220b1) first. Carries strata.gz, tokenizers-qwen2.5.tgz, llama-src.tar.xz.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call24
pack_every 10
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
(qwen7b_checkpoint; qwen7b_q4_k_m) > "$OUT/prepare.log" 2>&1
tail -1 "$OUT/prepare.log"
bench() {  # name slab_mib model [args]
    [ $SECONDS -lt 470 ] || { echo "-- $1 skipped (t=$SECONDS)"; return; }
    local name=$1 slab=$2 model=$3; shift 3
    STRATA_DEQUANT_SLAB_MIB=$slab timeout 90 env ${ENVS:-} $S bench-gpu --model $model --levels 256 --kv-cache-dtypes auto \
        --prompt-tokens 512 --output-tokens 128 --out "$OUT/bench_$name.json" "$@" 2>&1 |
        grep -v "outside the vocabulary" > "$OUT/bench_$name.log"
    echo "-- $name (t=$SECONDS)"; grep -E "decode-only" "$OUT/bench_$name.log" | cut -c1-170
}
echo "== benches (t=$SECONDS)"
bench q_whole_a 0 $Q4KM
bench q_slab16_a 16 $Q4KM
bench bf16_a 0 $Q7
bench q_slab8 8 $Q4KM
bench q_slab32 32 $Q4KM
bench q_slab16_b 16 $Q4KM
bench q_whole_b 0 $Q4KM
bench bf16_b 0 $Q7
ENVS=STRATA_QUANT_WIDE_MAX_TOKENS=4096 bench q_wide4096 0 $Q4KM
bench q_whole_8k 0 $Q4KM --max-num-batched-tokens 8192
bench bf16_8k 0 $Q7 --max-num-batched-tokens 8192
if [ $SECONDS -lt 500 ]; then
    STRATA_GPU_PROFILE=1 STRATA_DEQUANT_SLAB_MIB=16 timeout 80 $S bench-gpu --model $Q4KM --enforce-eager \
        --levels 256 --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 32 2>&1 |
        grep -v "outside the vocabulary" > "$OUT/profile_slab16_256.log"
    echo "-- profile (t=$SECONDS)"; grep -E "gemm|dequant" "$OUT/profile_slab16_256.log" | grep prefill | head -14 | cut -c1-110
fi
echo "end t=$SECONDS"
packer_stop
