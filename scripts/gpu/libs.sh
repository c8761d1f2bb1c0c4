#!/usr/bin/env bash
# Sourced by the GPU scripts: makes the CUDA and NCCL libraries loadable for strata's binaries and
# test binaries (in the scratch folder $shim, /tmp/strata-libshim unless set), unpacks what gpu-bin/
# carries, names the binary ($S) and the checkpoints' folder ($CK, Llama-3-8B's in $L8), and makes that
# checkpoint on demand (llama3_8b_checkpoint).
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
for f in gpu-bin/*.gz; do [ -e "$f" ] && gunzip -kf "$f" && chmod +x "${f%.gz}"; done
[ -d gpu-bin/tokenizers ] || [ ! -f gpu-bin/tokenizers.tgz ] || tar xzf gpu-bin/tokenizers.tgz -C gpu-bin
S=gpu-bin/strata
CK=/root/ckpt
L8=$CK/llama3-8b
# Makes the random-weight Llama-3-8B checkpoint in $L8 (transformers, no reference logits) unless
# one is there: for the scripts that only measure.
llama3_8b_checkpoint() {
    [ -f $L8/config.json ] || python3 scripts/gpu/hf_reference.py llama3-8b $L8 gpu-bin/tokenizers/llama3 --prompts-only 2>&1 |
        grep -v -i warn
}
