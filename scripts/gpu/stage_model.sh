#!/bin/bash
# On the GPU machine (no network): rebuilds the default model from parts carried in gpu-bin/
# over several calls (the working tree that travels is capped at 64 MiB), checked by sha256.
# Made here by build_bin.sh as gzip -9 of the model split into 40 MiB parts (gpu-bin/model.gz.part*,
# 92.7 MB in all): a first call carries model.gz.partaa beside strata.gz, tokenizers-qwen2.5.tgz
# and llama.cpp's sources, the next one (within the machine's idle release) the rest beside the
# speculation and CUDA test binaries.
set -u
CACHE=${STRATA_CACHE:-$HOME/.cache/strata}
mkdir -p "$CACHE/models" "$CACHE/parts"
cp -f gpu-bin/model.gz.part* "$CACHE/parts/" 2>/dev/null
MODEL="$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ -f "$MODEL" ] && echo "$SHA  $MODEL" | sha256sum -c --status; then echo "model: ready"; exit 0; fi
cat "$CACHE"/parts/model.gz.part* | gunzip > "$MODEL.tmp" 2>/dev/null
if echo "$SHA  $MODEL.tmp" | sha256sum -c --status; then mv "$MODEL.tmp" "$MODEL"; echo "model: ready"; else rm -f "$MODEL.tmp"; echo "model: parts so far: $(ls "$CACHE/parts")"; fi
