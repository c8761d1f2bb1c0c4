#!/usr/bin/env bash
# One H200, issue 28's GPU checks (outputs in $OUT): a random-weight Qwen2.5-7B with transformers'
# reference; the CUDA tests on it (the hardened GGUF/safetensors loaders on a real-size checkpoint);
# `strata bench-gpu` on it, whose prompts once held ids past Qwen's tokenizer (defect 9).
# Carries gpu-bin/ (strata.gz, cuda-test.gz, tokenizers-qwen2.5.tgz); no Rust toolchain, no network.
set -u
OUT=${OUT:-/tmp/out}
source "$(dirname "$0")/libs.sh"
Q7=$CK/qwen2.5-7b
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
[ -f $Q7/reference.json ] || python3 scripts/gpu/hf_reference.py qwen2.5-7b $Q7 gpu-bin/tokenizers/qwen2.5 2>&1 | grep -v -i warn
echo "== CUDA tests on Qwen2.5-7B"
STRATA_HF_CHECKPOINTS=$Q7 timeout ${TEST_TIMEOUT:-300} gpu-bin/cuda-test --nocapture --test-threads 1 2>&1 |
    tee "$OUT/cuda_tests.log" | grep -E "^test |GPU (bf16|f32)|float32|panicked|result|skipped"
echo "== bench-gpu qwen2.5-7b (prompt ids from the tokenizer's vocabulary)"
timeout 240 $S bench-gpu --model $Q7 --levels 1,64 --prompt-tokens 512 --output-tokens 128 \
    --out "$OUT/bench_qwen7b.json" > "$OUT/bench_qwen7b.log" 2>&1
echo "exit $?"; grep -v "^\s*$" "$OUT/bench_qwen7b.log" | grep -v -E "^\[" | tail -15
