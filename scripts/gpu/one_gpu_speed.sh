#!/usr/bin/env bash
# One H200, issue 6's checks and speed figures in one call (outputs in $OUT):
#   random Llama-3-8B and Qwen2.5-7B checkpoints (transformers) with reference logits and greedy text;
#   the CUDA tests (the kernels' own, GEMVs against cuBLASLt among them; checkpoints against
#   transformers; SmolLM2's when staged, against transformers too when the gguf wheel is carried:
#   libs.sh's smollm2_reference);
#   strata bench-gpu on Llama-3-8B as built, then once per AB variant, side by side in this run;
#   the eager per-kernel profile at each of PROFILE_LEVELS (default "1 256") streams.
# Carries gpu-bin/ (strata.gz, cuda-test.gz, cuda-kernels-test.gz, tokenizers-*.tgz); no Rust
# toolchain, no network.
# SKIP_QWEN=1 leaves out the Qwen2.5-7B checkpoint; SKIP_TESTS=1 the tests (and the references they
# need; TEST_TIMEOUT their limit in seconds, default 300); SKIP_BENCH=1 stops after the tests;
# SKIP_PROFILE=1 leaves out the profiles; WITH_TRANSFORMERS=1 adds transformers' own speed on the
# same checkpoint after strata's. AB="name:VAR=value[,VAR=value] ..." lists the variants benched after
# the build as is (default: the decode GEMVs off); LEVELS the concurrency levels (default
# 1,64,256), AB_LEVELS the variants' (default LEVELS). HOST_PROFILE_LEVELS="256 ..." adds the host
# time of each phase of a step with graphs (STRATA_GPU_PROFILE=1 without --enforce-eager), and
# HOST_PROFILE_AB="name:VAR=value ..." the same for variants. ATTENTION_SWEEP=1 times the attention
# kernels alone first. BASELINE=gpu-bin/NAME benches that binary too (an earlier version, carried
# gzipped like strata.gz) at AB_LEVELS, before the variants. ABLATE="name:KERNELS ..." benches the
# build at AB_LEVELS (bf16 KV) once per entry with those kernels left out of every step
# (bench-gpu --ablate; "+" for a space: o:gemm+4096x4096): what each costs inside a graph, where
# nothing later reads what they write. KV_DTYPES=auto benches only the default (bf16) KV cache.
set -u
OUT=${OUT:-/tmp/out}
source "$(dirname "$0")/libs.sh"
Q7=$CK/qwen2.5-7b
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
REF=${SKIP_TESTS:+--prompts-only}
[ -f $L8/reference.json ] || python3 scripts/gpu/hf_reference.py llama3-8b $L8 gpu-bin/tokenizers/llama3 $REF 2>&1 | grep -v -i warn
CKS=$L8
if [ -z "${SKIP_QWEN:-}${SKIP_TESTS:-}" ]; then
    [ -f $Q7/reference.json ] || python3 scripts/gpu/hf_reference.py qwen2.5-7b $Q7 gpu-bin/tokenizers/qwen2.5 2>&1 | grep -v -i warn
    CKS=$L8:$Q7
fi
[ -n "${SKIP_TESTS:-}" ] || ! smollm2_reference || CKS=$CKS:$SM
if [ -z "${SKIP_TESTS:-}" ]; then
    echo "== kernel tests"
    timeout ${TEST_TIMEOUT:-300} gpu-bin/cuda-kernels-test --nocapture --test-threads 1 --skip compile:: 2>&1 |
        tee "$OUT/cuda_kernels_tests.log" | grep -E "^test |panicked|result|skipped"
    echo "== CUDA tests"
    STRATA_HF_CHECKPOINTS=$CKS timeout ${TEST_TIMEOUT:-300} gpu-bin/cuda-test --nocapture --test-threads 1 2>&1 |
        tee "$OUT/cuda_tests.log" | grep -E "^test |GPU (bf16|f32)|vs CPU|vs bf16|float32|panicked|result|skipped"
fi
if [ -n "${SKIP_BENCH:-}" ]; then
    exit 0
fi
if [ -n "${ATTENTION_SWEEP:-}" ]; then
    echo "== attention kernels alone, 240 sequences, contexts 512..768"
    timeout 120 $S bench-gpu --attention --levels 240 --prompt-tokens 512 --output-tokens 256 \
        --out "$OUT/attention_sweep.json" 2>&1 | tee "$OUT/attention_sweep.log" | grep -v "^\["
fi
bench() { # NAME, LEVELS, then env assignments (VAR=value[,VAR=value])
    local name=$1 levels=$2; shift 2
    env ${*//,/ } timeout 240 ${BIN:-$S} bench-gpu --model $L8 --levels $levels --prompt-tokens 512 --output-tokens 256 \
        ${KV_DTYPES:+--kv-cache-dtypes $KV_DTYPES} --out "$OUT/bench_$name.json" > "$OUT/bench_$name.log" 2>&1
    echo "== bench-gpu llama3-8b, $name"; grep -v "^\s*$" "$OUT/bench_$name.log" | grep -v -E "^\[|loading" | tail -12
}
LEVELS=${LEVELS:-1,64,256}
bench built $LEVELS STRATA_BUILT=1
[ -z "${BASELINE:-}" ] || BIN=$BASELINE bench baseline "${AB_LEVELS:-$LEVELS}" STRATA_BUILT=0
for v in ${ABLATE:-}; do
    name=${v%%:*} kernels=${v#*:}
    timeout 240 $S bench-gpu --model $L8 --levels "${AB_LEVELS:-$LEVELS}" --kv-cache-dtypes auto --prompt-tokens 512 \
        --output-tokens 256 --ablate "${kernels//+/ }" --out "$OUT/ablate_$name.json" > "$OUT/ablate_$name.log" 2>&1
    echo "== without ${kernels//+/ }"; grep -E "^(bf16|fp8_e4m3) x" "$OUT/ablate_$name.log"
done
for v in ${AB-gemv_off:STRATA_GEMV_MAX_TOKENS=0}; do bench "${v%%:*}" "${AB_LEVELS:-$LEVELS}" ${v#*:}; done
if [ -n "${WITH_TRANSFORMERS:-}" ]; then
    echo "== transformers on the same checkpoint"
    timeout 150 python3 scripts/gpu/transformers_speed.py $L8 "$OUT/transformers_llama3_8b.json" 64 2>&1 |
        grep -v -i warn | tail -8 | tee "$OUT/transformers_llama3_8b.log"
fi
for lv in ${HOST_PROFILE_LEVELS:-}; do
    for v in built:STRATA_BUILT=1 ${HOST_PROFILE_AB:-}; do
        echo "== host time of a step at $lv streams with graphs, ${v%%:*}"
        a=${v#*:}
        env ${a//,/ } STRATA_GPU_PROFILE=1 timeout 150 $S bench-gpu --model $L8 --levels $lv --kv-cache-dtypes auto \
            --prompt-tokens 512 --output-tokens 128 --out "$OUT/host_${lv}_${v%%:*}.json" 2>&1 |
            grep -E "CUDA graph|host time per step|us/step|longest gap" | tee "$OUT/host_${lv}_${v%%:*}.log"
        rm -f "$OUT/host_${lv}_${v%%:*}.json"
    done
done
if [ -z "${SKIP_PROFILE:-}" ]; then
    for lv in ${PROFILE_LEVELS:-1 256}; do
        echo "== where the time goes at $lv streams (eager steps, GPU time of each kernel)"
        STRATA_GPU_PROFILE=1 timeout 150 $S bench-gpu --model $L8 --enforce-eager --levels $lv --kv-cache-dtypes auto \
            --prompt-tokens 512 --output-tokens ${PROFILE_OUTPUT:-64} --decode-tokens 64 --out "$OUT/profile_$lv.json" 2>&1 |
            grep -A70 "GPU profile" | tee "$OUT/profile_$lv.log" | head -40
        rm -f "$OUT/profile_$lv.json"
    done
fi
