#!/usr/bin/env bash
# Issue 30's FP8 figures on one H200 in one call: fp8.cu's, the GEMM's and quant.cu's kernel tests, then the
# random Qwen2.5-7B checkpoint (real tokenizer) in bf16 and converted to FP8 while it loads, at one
# stream and 256 users (`bench-gpu`, 512-token prompts, 128 out), beside the FP8 variants each knob
# turns (the decode products on tensor cores, STRATA_FP8_GEMV=mma; the integer E4M3 decode of
# sm_80/86 forced on; cuBLASLt's f32 promotion; cuBLASLt's outer-vector scales; the activation
# fusions off, STRATA_FUSE_FP8=0; RoPE in its own kernel after the QKV GEMV, STRATA_FP8_QKV_ROPE=0), and the eager
# per-kernel profile of FP8 steps at 1 and 256 tokens. With gpu-bin/cuda-test and the default
# model staged (stage_model.sh), SmolLM2's FP8 test with each decode GEMV. Carries
# gpu-bin/strata.gz, cuda-kernels-test.gz and tokenizers-qwen2.5.tgz (QUICK=1: kernel tests and the FP8
# single stream of each GEMV only; BARS=1: the FP8 bars alone; AB=DIR: a build against another, below). Outputs in $OUT/results_fp8.tgz,
# packed again after every step (a call cut off by its limit still brings back what ran).
set -u
OUT=${OUT:-/tmp/out}
source "$(dirname "$0")/libs.sh"
start_results fp8
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# bench NAME QUANTIZATION LEVELS [VAR=VALUE ...]: bench-gpu on the 7B checkpoint with the variables set.
bench() {
    local name=$1 quant=$2 levels=$3
    shift 3
    env "$@" timeout 220 $S bench-gpu --model $Q7 --quantization $quant --levels $levels --kv-cache-dtypes auto \
        --prompt-tokens 512 --output-tokens 128 --out "$OUT/bench_$name.json" > "$OUT/bench_$name.log" 2>&1
    echo "-- $name ($quant, levels $levels${*:+, $*}), exit $?"
    grep -E "weight matrices|^single stream|^\| (bf16|fp8) |tuned|error|Error" "$OUT/bench_$name.log" | cut -c1-200
    # The output tokens' hash at each level: the same weights and build give the same tokens.
    grep -o "x[0-9]* (0 constrained).*fnv1a [0-9a-f]*" "$OUT/bench_$name.log" | sed 's/ (0 constrained).*fnv1a/ fnv1a/'
    pack
}
# AB=DIR: a change to the FP8 GEMVs against the build in DIR (DIR/strata.gz, carried beside
# gpu-bin/strata.gz): fp8.cu's and the QKV GEMVs' kernel tests (when cuda-kernels-test.gz is
# carried), then the 7B's FP8 single stream, the two builds alternated twice (their output hashes
# side by side), ~8 min.
if [ -n "${AB:-}" ]; then
    gunzip -c "$AB/strata.gz" > /tmp/strata_base && chmod +x /tmp/strata_base
    if [ -x gpu-bin/cuda-kernels-test ]; then
        echo "== kernel tests: fp8 and rope (the QKV GEMVs with RoPE)"
        timeout 150 gpu-bin/cuda-kernels-test --nocapture --test-threads 1 --skip compile:: fp8 rope \
            > "$OUT/cuda_kernels_tests.log" 2>&1
        grep -E "^test |panicked|result|skipped" "$OUT/cuda_kernels_tests.log"
        pack
    fi
    qwen7b_checkpoint
    for round in 1 2; do
        bench "fp8_new_$round" fp8 1
        S=/tmp/strata_base bench "fp8_base_$round" fp8 1
    done
    exit 0
fi
# BARS=1: issue 30's two FP8 bars alone, the shortest call that gives them (~6 min): the 7B
# single stream and 256 users in bf16 and in FP8, no kernel tests and no variants.
if [ -n "${BARS:-}" ]; then
    qwen7b_checkpoint
    bench bf16 none 1,256
    bench fp8 fp8 1,256
    exit 0
fi
bash scripts/gpu/stage_model.sh
echo "== kernel tests: fp8, gemm, quant (the quantized formats' GEMVs and tensor-core GEMM) and rope (the QKV GEMVs with RoPE)"
timeout 240 gpu-bin/cuda-kernels-test --nocapture --test-threads 1 fp8 gemm quant rope > "$OUT/cuda_kernels_tests.log" 2>&1
grep -E "^test |panicked|result|skipped|cuBLASLt" "$OUT/cuda_kernels_tests.log"
echo "== kernel tests: fp8 with the integer E4M3 decode forced (the sm_80/86 fallback)"
STRATA_KERNEL_DEFINES=FP8_CVT=0 timeout 120 gpu-bin/cuda-kernels-test --nocapture --test-threads 1 fp8 \
    > "$OUT/cuda_kernels_tests_integer_decode.log" 2>&1
grep -E "^test |panicked|result|skipped" "$OUT/cuda_kernels_tests_integer_decode.log"
pack
if [ -x gpu-bin/cuda-test ] && [ -f "${STRATA_CACHE:-$HOME/.cache/strata}/models/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
    for gemv in lanes mma; do
        echo "== SmolLM2 with FP8 weights against bf16, $gemv GEMVs"
        STRATA_FP8_GEMV=$gemv timeout 200 gpu-bin/cuda-test --nocapture --test-threads 1 fp8 > "$OUT/cuda_test_fp8_$gemv.log" 2>&1
        grep -E "^test |panicked|result|FP8 weights" "$OUT/cuda_test_fp8_$gemv.log"
    done
    pack
fi
qwen7b_checkpoint
# QUICK=1: the FP8 single stream of each decode GEMV, after the kernel tests; the fusions off
# (STRATA_FUSE_FP8=0) and the build before them (gpu-bin/pre_fp8v5/strata.gz, when carried),
# twice each, for the output hash (bench/NOTES.md, FP8 v5); RoPE after the QKV GEMV (FP8 v6).
if [ -n "${QUICK:-}" ]; then
    bench fp8 fp8 1
    bench fp8_again fp8 1
    bench fp8_unfused fp8 1 STRATA_FUSE_FP8=0
    if [ -x gpu-bin/pre_fp8v5/strata ]; then
        S=gpu-bin/pre_fp8v5/strata bench fp8_pre_v5 fp8 1
        S=gpu-bin/pre_fp8v5/strata bench fp8_pre_v5_again fp8 1
    fi
    bench fp8_rope_after fp8 1 STRATA_FP8_QKV_ROPE=0
    bench fp8_mma fp8 1 STRATA_FP8_GEMV=mma
    bench fp8_mma_loads4 fp8 1 STRATA_FP8_GEMV=mma STRATA_KERNEL_DEFINES=FP8M_LOADS=4
    # All of a 3,584-column row pair in flight at once (7 loads a lane a row), as the bf16 GEMV has
    # its rows: 96 registers instead of 64 (ptxas), 20 warps an SM instead of 32.
    bench fp8_loads8 fp8 1 STRATA_KERNEL_DEFINES=FP8_LOADS=8
    exit 0
fi
bench bf16 none 1,256
bench fp8 fp8 1,256
bench fp8_unfused fp8 1,256 STRATA_FUSE_FP8=0
bench fp8_rope_after fp8 1 STRATA_FP8_QKV_ROPE=0
bench fp8_mma fp8 1,256 STRATA_FP8_GEMV=mma
bench fp8_integer fp8 1 STRATA_KERNEL_DEFINES=FP8_CVT=0
bench fp8_promoted fp8 256 STRATA_FP8_FAST_ACCUM=0
bench fp8_outer_scales fp8 256 STRATA_FP8_OUTER_SCALES=1
for run in "1 lanes" "1 mma" "256 lanes"; do
    set -- $run
    echo "== where an FP8 decode step goes at $1 tokens, $2 GEMVs (eager steps, GPU time of each kernel)"
    STRATA_FP8_GEMV=$2 STRATA_GPU_PROFILE=1 timeout 150 $S bench-gpu --model $Q7 --quantization fp8 --enforce-eager \
        --levels $1 --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 16 --decode-tokens 16 \
        --out /tmp/profile.json > "$OUT/profile_fp8_$1_$2.log" 2>&1
    grep -A30 "GPU profile" "$OUT/profile_fp8_$1_$2.log" | head -24
    pack
done
