#!/usr/bin/env bash
# Issue 27's GPU check: the build before the CUDA-layer step beside the build after it, in one
# run of four calls (the machine keeps its disk between calls made within its idle limit; each
# call's gpu-bin/ replaces the last, so binaries are kept in /root/strata-{before,after}):
# `prep` carries the first part of the default model and the tokenizers and makes a random
# Qwen2.5-7B (real tokenizer); `before` carries the rest of the model and the build before
# (gpu-bin/before/: strata.gz, cuda-test.gz) and runs its CUDA tests; `test` carries the build after
# (gpu-bin/: strata.gz, cuda-test.gz, cuda-kernels-test.gz, multi-gpu-test.gz), runs its CUDA,
# kernel and multi-GPU tests and bench-gpu on SmolLM2, the builds interleaved; `bench` compares both
# builds' greedy outputs on the CUDA tests' prompts (one GPU with and without graphs, and TP 2 and
# PP 2 when there are two; the fp8 cache is compared by the CUDA tests' printed errors) and runs
# bench-gpu on the Qwen2.5-7B. Outputs in $OUT.
set -u
OUT=${OUT:-/tmp/out}
source "$(dirname "$0")/libs.sh"
BEFORE=/root/strata-before
AFTER=/root/strata-after
mkdir -p $BEFORE $AFTER
for f in gpu-bin/before/*.gz; do [ -e "$f" ] && gunzip -c "$f" > "$BEFORE/$(basename "${f%.gz}")"; done
for f in gpu-bin/*.gz; do [ -e "$f" ] && gunzip -c "$f" > "$AFTER/$(basename "${f%.gz}")"; done
chmod +x $BEFORE/* $AFTER/* 2>/dev/null
GPUS=$(nvidia-smi -L | wc -l)
# cuda.rs's PROMPTS.
PROMPTS=("The capital of France is"
    $'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    "Photosynthesis converts light energy into"
    "Once upon a time, in a village by the sea, there lived")

# greedy BUILD_DIR LABEL ARGS...: 48 greedy tokens of each prompt into $OUT/greedy_LABEL.txt.
greedy() {
    local dir=$1 label=$2
    shift 2
    for p in "${PROMPTS[@]}"; do
        echo "== $p"
        timeout 120 "$dir/strata" run --prompt "$p" --max-tokens 48 "$@" 2>>"$OUT/greedy_$label.err"
        echo
    done > "$OUT/greedy_$label.txt"
}

# same LABEL ARGS...: both builds' greedy outputs with ARGS, and whether they are identical.
same() {
    local label=$1
    shift
    greedy $BEFORE "before_$label" "$@"
    greedy $AFTER "after_$label" "$@"
    if cmp -s "$OUT/greedy_before_$label.txt" "$OUT/greedy_after_$label.txt" &&
        [ -s "$OUT/greedy_after_$label.txt" ]; then
        echo "greedy $label: identical ($(grep -c . "$OUT/greedy_after_$label.txt") lines)"
    else
        echo "greedy $label: DIFFERENT"
        diff "$OUT/greedy_before_$label.txt" "$OUT/greedy_after_$label.txt" | head -20
    fi
}

# bench NAME ARGS...: bench-gpu before, after, before, after; the tables' last lines.
bench() {
    local name=$1
    shift
    for round in 1 2; do
        for build in before after; do
            local dir=$AFTER
            [ $build = before ] && dir=$BEFORE
            timeout 280 "$dir/strata" bench-gpu "$@" --out "$OUT/bench_${name}_${build}_$round.json" \
                > "$OUT/bench_${name}_${build}_$round.log" 2>&1
            echo "-- $name $build (round $round), exit $?"
            grep -E "^single stream|^\| (bf16|fp8) " "$OUT/bench_${name}_${build}_$round.log"
        done
    done
}

case "${1:-}" in
prep)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    bash scripts/gpu/stage_model.sh
    qwen7b_checkpoint
    ls $Q7 | head
    ;;
before)
    bash scripts/gpu/stage_model.sh
    echo "== CUDA tests, before"
    timeout 240 $BEFORE/cuda-test --nocapture --test-threads 1 > "$OUT/cuda_tests_before.log" 2>&1
    grep -E "^test |panicked|result|skipped" "$OUT/cuda_tests_before.log"
    ;;
test)
    bash scripts/gpu/stage_model.sh
    echo "== CUDA tests, after: the model's, then the kernels' (strata-runtime)"
    timeout 240 $AFTER/cuda-test --nocapture --test-threads 1 > "$OUT/cuda_tests_after.log" 2>&1
    grep -E "^test |panicked|result|skipped" "$OUT/cuda_tests_after.log"
    timeout 180 $AFTER/cuda-kernels-test --nocapture --test-threads 1 --skip compile:: > "$OUT/cuda_kernels_tests_after.log" 2>&1
    grep -E "^test |panicked|result|skipped" "$OUT/cuda_kernels_tests_after.log"
    if [ "$GPUS" -ge 2 ]; then
        echo "== multi-GPU tests, after"
        timeout 240 $AFTER/multi-gpu-test --nocapture --test-threads 1 > "$OUT/multi_gpu_tests_after.log" 2>&1
        grep -E "^test |panicked|result|skipped" "$OUT/multi_gpu_tests_after.log"
    fi
    echo "== bench-gpu smollm2"
    bench smollm2 --levels 1,64,256 --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 256
    ;;
bench)
    echo "== greedy outputs on the CUDA tests' prompts, before and after"
    same one_gpu --device cuda:0
    same one_gpu_eager --device cuda:0 --enforce-eager
    if [ "$GPUS" -ge 2 ]; then
        same tp2 --device cuda --tp 2 --pp 1
        same pp2 --device cuda --tp 1 --pp 2
    fi
    echo "== bench-gpu qwen2.5-7b (random weights, real tokenizer)"
    bench qwen7b --model $Q7 --levels 1,64 --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 128
    ;;
*) echo "usage: before_after.sh prep|before|test|bench"; exit 2 ;;
esac
