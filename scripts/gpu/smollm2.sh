#!/bin/bash
# On the GPU machine: the CUDA backend on the default model. Expects gpu-bin/{strata,cuda-test,
# cuda-kernels-test}.gz (built here, stripped: strata-model's `cuda` and strata-runtime's
# `cuda_kernels` test binaries) and the model staged by stage_model.sh; writes logs and JSON to $OUT.
set -u
OUT=${OUT:-/tmp/out}
source "$(dirname "$0")/libs.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
echo "== kernel tests"; gpu-bin/cuda-kernels-test --nocapture --test-threads 1 --skip compile:: 2>&1 | tee "$OUT/cuda_kernels_tests.log" | grep -E "test |panicked|result"
echo "== cuda tests"; gpu-bin/cuda-test --nocapture --test-threads 1 2>&1 | tee "$OUT/cuda_tests.log" | grep -E "test |GPU vs|fp8|panicked|result"
echo "== run: GPU vs CPU greedy text"
for d in cuda cpu; do $S run --device $d --prompt "The capital of France is" --max-tokens 24 2>&1 | tee -a "$OUT/run.log"; done
echo "== bench-gpu smollm2"
$S bench-gpu --levels 1,64,256 --output-tokens 128 --out "$OUT/gpu_bench_smollm2.json" 2>&1 | tail -12 | tee "$OUT/bench_smollm2.log"
