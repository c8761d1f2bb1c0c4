#!/bin/sh
# Puts the CUDA 13 libraries strata dlopens (the hash-pinned wheels of cuda-requirements.txt) into one
# folder, with the bare name libnccl.so that cudarc asks for: the image's `cuda` target runs this.
# usage: install-cuda-libs.sh DEST [REQUIREMENTS]
set -eu
dest="$1"
requirements="${2:-$(dirname "$0")/cuda-requirements.txt}"
wheels=$(mktemp -d)
python3 -m pip install --quiet --no-deps --only-binary=:all: --require-hashes --no-cache-dir \
    --target "$wheels" -r "$requirements"
mkdir -p "$dest"
# What crates/strata-runtime/src/cuda/libraries.rs loads, and NVRTC's builtins beside it.
for lib in cu13/lib/libnvrtc.so.13 cu13/lib/libnvrtc-builtins.so.13.0 \
           cu13/lib/libcublas.so.13 cu13/lib/libcublasLt.so.13 nccl/lib/libnccl.so.2; do
    cp "$wheels/nvidia/$lib" "$dest/"
done
ln -sf libnccl.so.2 "$dest/libnccl.so"
rm -rf "$wheels"
