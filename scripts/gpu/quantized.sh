#!/usr/bin/env bash
# Issue 30's GPU runs: quantized GGUF weights on one H200 beside llama.cpp CUDA, in calls made
# back to back (the machine keeps its disk between calls within its idle limit). Outputs in $OUT as
# results_MODE.tgz, packed every 15 s.
#   decode: a fresh machine (carries strata.gz, cuda-kernels-test.gz, tokenizers-qwen2.5.tgz and
#     llama-src.tar.xz: the pinned llama-cpp-python sdist's vendor/llama.cpp without docs, models,
#     tests and other backends, and llama-bin.tar.xz.part* from an earlier call or `make
#     gpu-bin-llama`, ~39 MB in all; without the parts it builds llama-bench, llama-quantize and
#     llama-server with CUDA for sm_90 in the background, saved under $OUT as 15 MB parts to carry
#     next time, while the quantized kernels' test runs); makes a random Qwen2.5-7B (real
#     tokenizer), converts it with llama.cpp's convert_hf_to_gguf.py and quantizes it to Q4_K_M
#     with llama-quantize; then per
#     round (ROUNDS, default 1) llama-bench pp512/tg128 beside strata's bench-gpu at LEVELS
#     (default 1,256) on the Q4_K_M file, the bf16 checkpoint and that checkpoint as FP8 (MODELS,
#     default "q4_k_m bf16 fp8").
#     PROFILE=1 adds the eager per-kernel profile of a Q4_K_M prompt and decode steps;
#     KERNEL_TESTS names the kernel tests to run (default all).
#   test: carries the model's other parts and cuda-test.gz: the CUDA tests (the default model's
#     Q4_1 kept on the GPU, and SmolLM2 re-quantized by `strata quantize` to each type against
#     the CPU backend; CUDA_TESTS names the tests, default all), the SmolLM2 and quantized-file tests
#     again as an Ampere card (STRATA_GPU_CAPABILITY=8.0), and SmolLM2's FP8 test on the
#     tensor-core GEMVs (STRATA_FP8_GEMV=mma) both ways; the quantized-file tests again with every
#     product past the GEMVs on the tensor-core GEMM, then the GEMMs' kernel test (the tiles as
#     compiled by default, wgmma on a 9.0 GPU, with both decodes, without the overlapped decode,
#     warp-specialized, and on the portable target's mma.sync; carries cuda-kernels-test.gz too)
#     and the quantized-file tests on the tiles, on wgmma, warp-specialized and on mma.sync.
#   profile: where a 256-user decode step of a Qwen2.5-7B-shaped Q4_K_M goes (eager steps, the GPU
#     time of each kernel), beside bf16's, and 16-256
#     users: dequantized for cuBLASLt (STRATA_QUANT_GEMM_MAX_TOKENS=0), the defaults (the GEMM to
#     256 tokens, its wgmma tiles from 128 on a 9.0 GPU), the portable target's mma.sync tiles
#     (STRATA_KERNEL_ARCH=compute_90) and the warp-specialized wgmma tiles (QTILE_SPECIALIZED=1), levels
#     PROFILE_LEVELS (PROFILE_SETTINGS replaces the list, PROFILE_BINS runs it with other builds
#     too; PROFILE_EAGER names the files to profile eagerly, default both, empty for none); the
#     file written by `strata quantize --random-weights`
#     from the 7B checkpoint's vocabulary (seeds_32b.sh makes both; llama-src.tar.xz otherwise).
#   single: the Q4_K_M file's single stream: an eager per-kernel profile of its decode steps, then
#     the default against each of SINGLE_DEFINES (STRATA_KERNEL_DEFINES values; default QGEMV_LOADS=4
#     and QGEMV_SILU_PAIRS=1), twice
#     (carries strata.gz, tokenizers-qwen2.5.tgz, llama-src.tar.xz).
set -u
OUT=${OUT:-/tmp/out}
source "$(dirname "$0")/libs.sh"
# At most 8 files come back from $OUT: the figures and logs in one archive, results_MODE.tgz,
# packed every 15 s, so a call cut off by its limit still brings back what ran.
start_results "${1:-none}"
pack_every 15
LL=/root/llama.cpp
GG=/root/gguf
mkdir -p $GG

# llama-bench on FILE: pp512 and tg128, all layers on the GPU, into $OUT/llama_bench_NAME.json.
llama_bench() {
    local file=$1 name=$2
    timeout 240 $LL/build/bin/llama-bench -m "$file" -p 512 -n 128 -ngl 99 -r 3 -o json \
        > "$OUT/llama_bench_$name.json" 2> "$OUT/llama_bench_$name.err"
    python3 - "$OUT/llama_bench_$name.json" "$name" <<'EOF'
import json, sys
for r in json.load(open(sys.argv[1])):
    kind = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
    print(f"llama.cpp {sys.argv[2]} {kind}: {r['avg_ts']:.1f} tok/s (+- {r['stddev_ts']:.1f})")
EOF
}

# llama.cpp's CUDA binaries in $LL/build/bin: unpacked from carried parts, or built from the
# carried source (then /tmp/llama_build.done holds the build's exit line).
llama_cpp() {
    mkdir -p $LL
    [ -f $LL/convert_hf_to_gguf.py ] || tar xJf gpu-bin/llama-src.tar.xz -C $LL
    if ls gpu-bin/llama-bin.tar.xz.part* >/dev/null 2>&1; then
        cat gpu-bin/llama-bin.tar.xz.part* | tar xJf - -C $LL
        echo "llama.cpp: carried binaries" > /tmp/llama_build.done
        return
    fi
    (cd $LL && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=ON > /tmp/llama_cmake.log 2>&1 &&
        cmake --build build -j 14 --target llama-bench llama-quantize llama-server > /tmp/llama_build.log 2>&1
        echo "llama.cpp build exit $?" > /tmp/llama_build.done)
}

# strata bench-gpu at LEVELS on the Q4_K_M file (name q4_k_m), the bf16 checkpoint (bf16), or that
# checkpoint converted to FP8 E4M3 while it loads (fp8).
strata_bench() {
    local m=$1 round=$2 file=$GG/qwen7b-q4_k_m.gguf quant=auto
    [ $m = bf16 ] && file=$Q7
    [ $m = fp8 ] && file=$Q7 && quant=fp8
    timeout 240 $S bench-gpu --model $file --quantization $quant --levels ${LEVELS:-1,256} --kv-cache-dtypes auto \
        --prompt-tokens 512 --output-tokens 128 --out "$OUT/bench_${m}_$round.json" > "$OUT/bench_${m}_$round.log" 2>&1
    echo "-- strata $m (round $round), exit $?"
    grep -E "weight matrices|^single stream|prompt|^\| (bf16|fp8) " "$OUT/bench_${m}_$round.log"
}

case "${1:-}" in
decode)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    rm -f /tmp/llama_build.done
    llama_cpp &
    echo "== kernel tests ${KERNEL_TESTS:-}"
    timeout 240 gpu-bin/cuda-kernels-test --nocapture --test-threads 1 --skip compile:: ${KERNEL_TESTS:-} > "$OUT/cuda_kernels_tests.log" 2>&1
    grep -E "^test |panicked|result|skipped" "$OUT/cuda_kernels_tests.log"
    qwen7b_checkpoint
    while [ ! -f $LL/convert_hf_to_gguf.py ]; do sleep 1; done
    [ -f $GG/qwen7b-bf16.gguf ] || [ -f $GG/qwen7b-q4_k_m.gguf ] ||
        timeout 300 python3 $LL/convert_hf_to_gguf.py $Q7 --outtype bf16 --outfile $GG/qwen7b-bf16.gguf \
            > /tmp/convert.log 2>&1 || tail -5 /tmp/convert.log
    while [ ! -f /tmp/llama_build.done ]; do sleep 5; done
    cat /tmp/llama_build.done; tail -3 /tmp/llama_build.log 2>/dev/null
    [ -f $GG/qwen7b-q4_k_m.gguf ] || timeout 200 $LL/build/bin/llama-quantize $GG/qwen7b-bf16.gguf \
        $GG/qwen7b-q4_k_m.gguf Q4_K_M > /tmp/quantize.log 2>&1 || tail -5 /tmp/quantize.log
    rm -f $GG/qwen7b-bf16.gguf
    ls gpu-bin/llama-bin.tar.xz.part* >/dev/null 2>&1 || (cd $LL && tar cJf /tmp/llama-bin.tar.xz build/bin &&
        split -b 15M /tmp/llama-bin.tar.xz "$FINAL_OUT/llama-bin.tar.xz.part")
    for round in $(seq ${ROUNDS:-1}); do
        llama_bench $GG/qwen7b-q4_k_m.gguf "q4_k_m_$round"
        for m in ${MODELS:-q4_k_m bf16 fp8}; do strata_bench $m $round; done
    done
    if [ -n "${PROFILE:-}" ]; then
        echo "== where a Q4_K_M decode step goes at 1 stream (eager steps, GPU time of each kernel)"
        STRATA_GPU_PROFILE=1 timeout 120 $S bench-gpu --model $GG/qwen7b-q4_k_m.gguf --enforce-eager --levels 1 \
            --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 64 --decode-tokens 64 --out /tmp/profile.json 2>&1 |
            grep -A40 "GPU profile" > "$OUT/profile_q4_k_m_1.log"
        head -24 "$OUT/profile_q4_k_m_1.log"
    fi
    ;;
test)
    bash scripts/gpu/stage_model.sh
    MODEL=${STRATA_CACHE:-$HOME/.cache/strata}/models/SmolLM2-135M-Instruct.Q4_1.gguf
    QM=/root/smollm2-quant
    mkdir -p $QM
    for t in Q4_0 Q8_0 Q4_K Q5_K Q6_K Q4_K_M; do
        [ -f $QM/smollm2-$t.gguf ] || timeout 120 $S quantize "$MODEL" $QM/smollm2-$t.gguf --type $t \
            > "$OUT/quantize_$t.log" 2>&1 || tail -3 "$OUT/quantize_$t.log"
    done
    echo "== CUDA tests"
    ls $QM/*.gguf >/dev/null 2>&1 && export STRATA_QUANT_MODELS=$QM
    timeout 300 gpu-bin/cuda-test --nocapture --test-threads 1 ${CUDA_TESTS:-} > "$OUT/cuda_tests.log" 2>&1
    grep -E "^test |GPU vs CPU|vs CPU over|FP8 weights vs|panicked|result|skipped" "$OUT/cuda_tests.log"
    echo "== CUDA tests as an sm_80 card (STRATA_GPU_CAPABILITY=8.0)"
    STRATA_GPU_CAPABILITY=8.0 timeout 200 gpu-bin/cuda-test --nocapture --test-threads 1 smollm2 quantized \
        > "$OUT/cuda_tests_sm80.log" 2>&1
    grep -E "^test |vs CPU|FP8 weights vs|panicked|result|skipped" "$OUT/cuda_tests_sm80.log"
    echo "== quantized files with every product of up to 1024 tokens as GEMV passes (STRATA_QUANT_GEMV_MAX_TOKENS)"
    STRATA_QUANT_GEMV_MAX_TOKENS=1024 timeout 200 gpu-bin/cuda-test --nocapture --test-threads 1 quantized \
        > "$OUT/cuda_tests_gemv_passes.log" 2>&1
    grep -E "^test |vs CPU|panicked|result|skipped" "$OUT/cuda_tests_gemv_passes.log"
    echo "== quantized files with every product past the GEMVs on the tensor-core GEMM (STRATA_QUANT_GEMM_MAX_TOKENS)"
    STRATA_QUANT_GEMM_MAX_TOKENS=1024 timeout 200 gpu-bin/cuda-test --nocapture --test-threads 1 quantized \
        > "$OUT/cuda_tests_qgemm.log" 2>&1
    grep -E "^test |vs CPU|panicked|result|skipped" "$OUT/cuda_tests_qgemm.log"
    echo "== the tensor-core GEMMs' kernel test: as compiled by default (wgmma tiles on a 9.0 GPU), the tiles"
    echo "   decoding by 8-value slices, wgmma without the overlapped decode, warp-specialized, and the"
    echo "   portable target (mma.sync)"
    for setting in STRATA_KERNEL_DEFINES=QTILE_UNIT32=1 STRATA_KERNEL_DEFINES=QTILE_UNIT32=0 \
        STRATA_KERNEL_DEFINES=QTILE_OVERLAP=0 STRATA_KERNEL_DEFINES=QTILE_SPECIALIZED=1 STRATA_KERNEL_ARCH=compute_90; do
        name=$(echo "${setting#*=}" | tr '=' '_')
        env "$setting" timeout 150 gpu-bin/cuda-kernels-test --nocapture --test-threads 1 quantized_gemm \
            > "$OUT/kernels_qgemm_$name.log" 2>&1
        echo "-- $setting"; grep -E "^test |panicked|result" "$OUT/kernels_qgemm_$name.log"
    done
    echo "== the same on the GEMM's shared-memory tiles (STRATA_QUANT_GEMM_TILE_MIN_TOKENS=9), as compiled by"
    echo "   default (wgmma on a 9.0 GPU), warp-specialized, then on the portable target (mma.sync)"
    for setting in STRATA_KERNEL_DEFINES=QTILE_SPECIALIZED=0 STRATA_KERNEL_DEFINES=QTILE_SPECIALIZED=1 \
        STRATA_KERNEL_ARCH=compute_90; do
        name=$(echo "${setting#*=}" | tr '=' '_')
        env "$setting" STRATA_QUANT_GEMM_MAX_TOKENS=1024 STRATA_QUANT_GEMM_TILE_MIN_TOKENS=9 \
            timeout 200 gpu-bin/cuda-test --nocapture --test-threads 1 quantized > "$OUT/cuda_tests_qgemm_tile_$name.log" 2>&1
        echo "-- $setting"; grep -E "^test |vs CPU|panicked|result|skipped" "$OUT/cuda_tests_qgemm_tile_$name.log"
    done
    echo "== SmolLM2's FP8 test on the tensor-core GEMVs (STRATA_FP8_GEMV=mma), as is and as an sm_80 card"
    for cap in "" 8.0; do
        env ${cap:+STRATA_GPU_CAPABILITY=$cap} STRATA_FP8_GEMV=mma timeout 150 gpu-bin/cuda-test --nocapture --test-threads 1 fp8 \
            > "$OUT/cuda_tests_fp8_mma${cap:+_sm80}.log" 2>&1
        grep -E "^test |FP8 weights vs|panicked|result|skipped" "$OUT/cuda_tests_fp8_mma${cap:+_sm80}.log"
    done
    ;;
profile)
    F=$Q4KM
    qwen7b_checkpoint
    qwen7b_q4_k_m
    # PROFILE_BINS: strata binaries to profile and run each setting with (default gpu-bin/strata;
    # another build carried as gpu-bin/DIR/strata.gz, unpacked by libs.sh, prefixes its files
    # with DIR's name).
    tag_of() { [ "$1" = "$S" ] || echo "$(basename "$(dirname "$1")")_"; }
    for bin in ${PROFILE_BINS:-$S}; do
        for m in ${PROFILE_EAGER-$F $Q7}; do
            name=$(tag_of $bin)$([ $m = $F ] && echo q4_k_m || echo bf16)
            echo "== where a 256-user decode step goes, $name"
            STRATA_GPU_PROFILE=1 timeout 200 $bin bench-gpu --model $m --enforce-eager --levels 256 --kv-cache-dtypes auto \
                --prompt-tokens 512 --output-tokens 32 --decode-tokens 32 --out "$OUT/profile_${name}_256.json" \
                > "$OUT/profile_${name}_256.log" 2>&1
            grep -A30 "GPU profile" "$OUT/profile_${name}_256.log" | head -32
        done
    done
    echo "== 16-256 users: bf16, then the Q4_K_M file dequantized for cuBLASLt, as strata runs it by default, on"
    echo "   the portable target's mma.sync tiles and on warp-specialized wgmma tiles"
    timeout 200 $S bench-gpu --model $Q7 --levels ${PROFILE_LEVELS:-16,64,256} --kv-cache-dtypes auto \
        --prompt-tokens 512 --output-tokens 128 --decode-tokens 64 --out "$OUT/bench_bf16.json" > "$OUT/bench_bf16.log" 2>&1
    echo "-- bf16, exit $?"
    grep -E "^single stream|^\| (bf16|fp8) " "$OUT/bench_bf16.log" | cut -c1-200
    # Each setting is one or more VAR=VALUE separated by commas; its files are named after it.
    for bin in ${PROFILE_BINS:-$S}; do
        for setting in ${PROFILE_SETTINGS:-STRATA_QUANT_GEMM_MAX_TOKENS=0 STRATA_QUANT_GEMM_TILE_MIN_TOKENS=128 \
            STRATA_KERNEL_ARCH=compute_90 STRATA_KERNEL_DEFINES=QTILE_SPECIALIZED=1}; do
            name=$(tag_of $bin)$(echo "$setting" | tr '=,' '__')
            env ${setting//,/ } timeout 200 $bin bench-gpu --model $F --levels ${PROFILE_LEVELS:-16,64,256} \
                --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 128 --decode-tokens 64 \
                --out "$OUT/bench_q4_k_m_$name.json" > "$OUT/bench_q4_k_m_$name.log" 2>&1
            echo "-- $bin $setting, exit $?"
            grep -E "^single stream|^\| (bf16|fp8) " "$OUT/bench_q4_k_m_$name.log" | cut -c1-200
        done
    done
    ;;
single)
    # Where a Q4_K_M single-stream token goes now (eager, the GPU time of each kernel; last taken
    # at v23), then the single stream as built against each of SINGLE_DEFINES (default: 4 units in
    # flight a lane instead of 2, and the SiLU GEMV's gate and up rows in one pass), twice.
    qwen7b_checkpoint
    qwen7b_q4_k_m
    STRATA_GPU_PROFILE=1 timeout 150 $S bench-gpu --model $Q4KM --enforce-eager --levels 1 --kv-cache-dtypes auto \
        --prompt-tokens 512 --output-tokens 16 --decode-tokens 16 --out /tmp/profile.json \
        > "$OUT/profile_q4_k_m_1.log" 2>&1
    grep -A30 "GPU profile" "$OUT/profile_q4_k_m_1.log" | grep decode
    for round in 1 2; do
        # The second round only while the call has time for it.
        [ $round = 2 ] && [ $SECONDS -gt 380 ] && break
        for defines in "" ${SINGLE_DEFINES:-QGEMV_LOADS=4 QGEMV_SILU_PAIRS=1}; do
            name=q4_k_m_${defines:-default}_$round
            env ${defines:+STRATA_KERNEL_DEFINES=$defines} timeout 150 $S bench-gpu --model $Q4KM --levels 1 \
                --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 128 --out "$OUT/bench_$name.json" \
                > "$OUT/bench_$name.log" 2>&1
            echo "-- $name, exit $?"
            grep -E "^single stream" "$OUT/bench_$name.log"
        done
    done
    ;;
*) echo "usage: quantized.sh decode|test|profile|single"; packer_stop; exit 2 ;;
esac
packer_stop
