#!/usr/bin/env bash
# One H200, issue 29's GPU checks, in three calls (the machine keeps its disk between calls made
# within its idle limit): `prep` stages the first half of the default model and makes a random
# Qwen2.5-7B (real tokenizer); `test` stages the rest and runs the CUDA tests (the kernels' own,
# sampling.cu's apply_row_adjust against the host rule among them, then masked rows in eager and
# graph steps and every other model test) and bench-gpu on SmolLM2 with half the requests
# constrained; `bench` does the same bench on the Qwen2.5-7B (a 152k vocabulary: the largest
# masks). Outputs in $OUT.
# Carries gpu-bin/ (model.part*, strata.gz, cuda-test.gz, cuda-kernels-test.gz, tokenizers-qwen2.5.tgz).
set -u
OUT=${OUT:-/tmp/out}
source "$(dirname "$0")/libs.sh"
case "${1:-}" in
prep)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    bash scripts/gpu/stage_model.sh
    qwen7b_checkpoint
    ls $Q7 | head
    ;;
test)
    bash scripts/gpu/stage_model.sh
    echo "== kernel tests"
    timeout 300 gpu-bin/cuda-kernels-test --nocapture --test-threads 1 --skip compile:: 2>&1 | tee "$OUT/cuda_kernels_tests.log" |
        grep -E "^test |apply_row|panicked|result|skipped"
    echo "== CUDA tests (default model)"
    timeout 300 gpu-bin/cuda-test --nocapture --test-threads 1 2>&1 | tee "$OUT/cuda_tests.log" |
        grep -E "^test |masked and biased|GPU vs|panicked|result|skipped"
    echo "== bench-gpu smollm2, 64 users, half constrained beside none"
    timeout 200 $S bench-gpu --levels 64 --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 256 \
        --constrained 0.5 --out "$OUT/bench_smollm2_constrained.json" > "$OUT/bench_smollm2_constrained.log" 2>&1
    echo "exit $?"; grep -v "^\s*$" "$OUT/bench_smollm2_constrained.log" | grep -v -E "^\[" | tail -9
    ;;
bench)
    echo "== bench-gpu qwen2.5-7b (random weights, real tokenizer), 64 users, half constrained beside none"
    timeout 400 $S bench-gpu --model $Q7 --levels 64 --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 256 \
        --constrained 0.5 --out "$OUT/bench_qwen7b_constrained.json" > "$OUT/bench_qwen7b_constrained.log" 2>&1
    echo "exit $?"; grep -v "^\s*$" "$OUT/bench_qwen7b_constrained.log" | grep -v -E "^\[" | tail -9
    ;;
*) echo "usage: constrained.sh prep|test|bench"; exit 2 ;;
esac
