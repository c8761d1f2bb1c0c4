#!/usr/bin/env bash
# Sourced by the GPU scripts: makes the CUDA and NCCL libraries loadable for strata's binaries and
# test binaries (in the scratch folder $shim, /tmp/strata-libshim unless set), unpacks what gpu-bin/
# carries (the test binaries: cuda-test.gz from `cargo test --release -p strata-model --features cuda
# --test cuda --no-run`, cuda-kernels-test.gz from `... -p strata-runtime --features cuda --test
# cuda_kernels --no-run`, each executable gzipped), names the binary ($S) and the checkpoints'
# folder ($CK, Llama-3-8B's in $L8), and makes that checkpoint on demand (llama3_8b_checkpoint).
# cudarc dlopens bare names (libcuda.so.1, libnccl.so): put every likely folder on the path,
# including Python's site-packages/nvidia/*/lib, and give libnccl.so.2 the bare name it wants.
libdirs=(/usr/local/cuda/lib64 /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu)
for d in /usr/local/lib/python3*/dist-packages/nvidia/*/lib /usr/lib/python3*/dist-packages/nvidia/*/lib \
         /usr/local/lib/python3*/site-packages/nvidia/*/lib "$HOME"/.local/lib/python3*/site-packages/nvidia/*/lib; do
    [ -d "$d" ] && libdirs+=("$d")
done
if command -v python3 >/dev/null; then
    for d in $(python3 -c 'import site,glob; [print(p) for s in site.getsitepackages() for p in glob.glob(s+"/nvidia/*/lib")]' 2>/dev/null); do
        libdirs+=("$d")
    done
fi
shim=${shim:-/tmp/strata-libshim}
mkdir -p "$shim"
for d in "${libdirs[@]}"; do
    if [ ! -e "$shim/libnccl.so" ] && [ -e "$d/libnccl.so.2" ] && [ ! -e "$d/libnccl.so" ]; then
        ln -s "$d/libnccl.so.2" "$shim/libnccl.so"
    fi
done
LD_LIBRARY_PATH="$shim:$(IFS=:; echo "${libdirs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH

export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p "${OUT:=/tmp/out}"
# Unpacks a .gz only when it is newer than its binary (gunzip gives the binary its mtime): a
# script started beside another (seeds_32b.sh PREP=1) never rewrites a binary the other runs.
# Other builds carried for side-by-side runs sit one folder down (gpu-bin/v29/strata.gz).
for f in gpu-bin/*.gz gpu-bin/*/*.gz; do [ -e "$f" ] && [ "$f" -nt "${f%.gz}" ] && gunzip -kf "$f" && chmod +x "${f%.gz}"; done
# The real tokenizers, one archive a family (gpu-bin/tokenizers-qwen2.5.tgz, tokenizers-llama3.tgz).
for f in gpu-bin/tokenizers-*.tgz; do
    [ -e "$f" ] || continue
    fam=${f#gpu-bin/tokenizers-}
    [ -d "gpu-bin/tokenizers/${fam%.tgz}" ] || tar xzf "$f" -C gpu-bin
done
S=gpu-bin/strata
# start_results NAME: the script's outputs go to /tmp/NAME_results ($OUT from here on), and `pack`
# (after every step) archives them as $FINAL_OUT/results_NAME.tgz: a call cut off by its limit
# still brings back what ran, in one file (a call brings back only a few).
start_results() {
    FINAL_OUT=$OUT
    RESULTS_NAME=$1
    OUT=/tmp/$1_results
    mkdir -p "$OUT"
}
# The archive is written beside its name and then renamed, so a call cut off mid-write still
# brings back the last whole one.
pack() {
    tar czf "$FINAL_OUT/.results_$RESULTS_NAME.tgz" -C "$OUT" . &&
        mv -f "$FINAL_OUT/.results_$RESULTS_NAME.tgz" "$FINAL_OUT/results_$RESULTS_NAME.tgz"
}
# pack_every SECONDS: packs in the background until the script ends (packer_stop, then pack).
pack_every() { (while sleep "$1"; do pack; done) & PACKER=$!; }
packer_stop() { kill "$PACKER" 2>/dev/null; wait "$PACKER" 2>/dev/null; pack; }
CK=/root/ckpt
L8=$CK/llama3-8b
# Makes the random-weight Llama-3-8B checkpoint in $L8 (transformers, no reference logits) unless
# one is there: for the scripts that only measure.
llama3_8b_checkpoint() {
    [ -f $L8/config.json ] || python3 scripts/gpu/hf_reference.py llama3-8b $L8 gpu-bin/tokenizers/llama3 --prompts-only 2>&1 |
        grep -v -i warn
}
Q7=$CK/qwen2.5-7b-prompts
# Makes the random-weight Qwen2.5-7B checkpoint (real tokenizer, prompts, no reference logits) in
# $Q7 unless one is there: for the scripts that only measure.
qwen7b_checkpoint() {
    [ -f $Q7/config.json ] || python3 scripts/gpu/hf_reference.py qwen2.5-7b $Q7 gpu-bin/tokenizers/qwen2.5 \
        --prompts-only 2>&1 | grep -v -i warn | tail -3
}
# qwen_vocab_gguf FILE LLAMA_DIR: $Q7's vocabulary alone as a GGUF (llama.cpp's convert_hf_to_gguf.py
# --vocab-only, unpacked from gpu-bin/llama-src.tar.xz into LLAMA_DIR), the template `strata
# quantize --random-weights` takes for Qwen2.5 shapes; the converter's log beside it.
# Scripts started side by side (seeds_32b.sh PREP=1 beside quantized.sh) both want the file: the
# first makes it under a lock, and it appears whole (renamed), so the other never reads a part.
qwen_vocab_gguf() {
    local file=$1 ll=$2
    [ -f "$file" ] && return 0
    qwen7b_checkpoint
    mkdir -p "$ll" "$(dirname "$file")"
    (
        flock 9
        [ -f "$file" ] && exit 0
        [ -f "$ll/convert_hf_to_gguf.py" ] || tar xJf gpu-bin/llama-src.tar.xz -C "$ll"
        timeout 300 python3 "$ll/convert_hf_to_gguf.py" $Q7 --vocab-only --outfile "$file.partial" \
            > "${file%.gguf}.convert.log" 2>&1 && mv "$file.partial" "$file" || tail -5 "${file%.gguf}.convert.log"
    ) 9> "$file.lock"
}
# qwen7b_q4_k_m: $Q4KM, the 7B checkpoint's shapes as Q4_K_M with random weights, written by `strata
# quantize --random-weights` on $Q7's vocabulary (llama-src.tar.xz carried) unless it is there.
Q4KM=/root/gguf/qwen7b-random-q4_k_m.gguf
qwen7b_q4_k_m() {
    [ -f $Q4KM ] && return 0
    mkdir -p /root/gguf
    qwen_vocab_gguf /root/gguf/qwen7b-vocab.gguf /root/llama.cpp
    timeout 300 $S quantize /root/gguf/qwen7b-vocab.gguf $Q4KM --type Q4_K_M --random-weights $Q7/config.json \
        --threads ${THREADS:-16} 2>&1 | tail -1
}
SM=$CK/smollm2
# The default model's reference with its real weights (smollm2_reference.py) in $SM, once the model
# is staged (stage_model.sh) and the `gguf` wheel carried: gpu-bin/gguf-0.17.1-py3-none-any.whl,
# from `pip download --no-deps gguf==0.17.1`. Returns non-zero when it cannot be made.
smollm2_reference() {
    local model=${STRATA_CACHE:-$HOME/.cache/strata}/models/SmolLM2-135M-Instruct.Q4_1.gguf
    local whl=gpu-bin/gguf-0.17.1-py3-none-any.whl
    [ -f $SM/reference.json ] && return 0
    [ -f "$model" ] && [ -f $whl ] || return 1
    echo "7bc5aa7eeb1931f7d39b48fdc5b38fda6b294b9dca75cf607ac69557840a3943  $whl" | sha256sum -c --status ||
        { echo "$whl: sha256 differs"; return 1; }
    pip install -q --no-deps --no-index --target /tmp/gguf-py $whl 2>&1 | grep -v -i warn
    # cuda.rs's PROMPTS.
    $S tokenize --model "$model" "The capital of France is" \
        $'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n' \
        "Photosynthesis converts light energy into" \
        "Once upon a time, in a village by the sea, there lived" > /tmp/smollm2_prompts.json
    PYTHONPATH=/tmp/gguf-py${PYTHONPATH:+:$PYTHONPATH} python3 scripts/gpu/smollm2_reference.py "$model" \
        /tmp/smollm2_prompts.json $SM 2>&1 | grep -v -i warn
    [ -f $SM/reference.json ]
}
# Waits up to $2 seconds (default 240) for a server on 127.0.0.1:$1 to answer /health.
wait_up() {
    for _ in $(seq $((2 * ${2:-240}))); do
        curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
        sleep 0.5
    done
    return 1
}
# bench_gpu NAME BIN MODEL LEVELS [VAR=VALUE ...]: BIN's bench-gpu on MODEL at LEVELS (512 tokens in,
# 128 out) with the variables set, into $OUT/bench_NAME.json and .log; prints the decode-only lines.
# None starts past LIMIT seconds of the script (default 400), so a call ends within its limit.
bench_gpu() {
    local name=$1 bin=$2 model=$3 levels=$4
    shift 4
    [ $SECONDS -lt ${LIMIT:-400} ] || { echo "-- $name skipped (t=$SECONDS)"; return; }
    env "$@" timeout 150 $bin bench-gpu --model $model --levels $levels --kv-cache-dtypes auto \
        --prompt-tokens 512 --output-tokens 128 --out "$OUT/bench_$name.json" 2>&1 |
        grep -v "outside the vocabulary" > "$OUT/bench_$name.log"
    echo "-- $name${*:+ ($*)} (t=$SECONDS)"
    grep -E "decode-only" "$OUT/bench_$name.log" | cut -c1-170
}
# profile_gpu NAME MODEL [VAR=VALUE ...]: the eager per-kernel GPU profile of $S at 256 users (512
# tokens in, 32 out) on MODEL with the variables set, into $OUT/profile_NAME.log; prints the wide
# tiles' lines at 192-256 tokens. LIMIT as bench_gpu's.
profile_gpu() {
    local name=$1 model=$2
    shift 2
    [ $SECONDS -lt ${LIMIT:-400} ] || { echo "-- $name skipped (t=$SECONDS)"; return; }
    env "$@" STRATA_GPU_PROFILE=1 timeout 150 $S bench-gpu --model $model --enforce-eager --levels 256 \
        --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 32 --decode-tokens 32 \
        --out "$OUT/profile_$name.json" 2>&1 | grep -v "outside the vocabulary" > "$OUT/profile_$name.log"
    echo "-- $name${*:+ ($*)} (t=$SECONDS)"
    grep -E "qgemm_wide.*x(19|2[0-9])[0-9]\)" "$OUT/profile_$name.log" | sort -k2,2 | head -16 | cut -c1-110
}
# begin_call NAME: a call script's start: its outputs to results_NAME.tgz, packed every 10 s, and
# the GPU's name, memory and driver in gpu.txt (and on the call's output).
begin_call() {
    start_results "$1"
    pack_every 10
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
}
