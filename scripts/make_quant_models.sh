#!/usr/bin/env bash
# SmolLM2-135M-Instruct re-quantized to each GGUF type the GPU correctness tests check, by
# `strata quantize`, into $STRATA_CACHE/models/quant/ (default ~/.cache/strata). Files already
# there are kept; the output is deterministic (same bytes on every machine and thread count).
#
# usage: scripts/make_quant_models.sh [TYPE ...]   (default: Q4_0 Q8_0 Q4_K Q5_K Q6_K Q4_K_M)
# STRATA_BIN picks the binary (default target/release/strata).
set -euo pipefail

cache="${STRATA_CACHE:-$HOME/.cache/strata}"
strata="${STRATA_BIN:-target/release/strata}"
source_model="$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
out_dir="$cache/models/quant"

if [ ! -x "$strata" ]; then
    echo "error: $strata not found; build it with \`make build\` (or set STRATA_BIN)" >&2
    exit 1
fi
if [ ! -f "$source_model" ]; then
    echo "error: $source_model not found; run \`make fetch\` first" >&2
    exit 1
fi
types=("$@")
if [ ${#types[@]} -eq 0 ]; then
    types=(Q4_0 Q8_0 Q4_K Q5_K Q6_K Q4_K_M)
fi
mkdir -p "$out_dir"
for ty in "${types[@]}"; do
    out="$out_dir/SmolLM2-135M-Instruct.$ty.gguf"
    if [ -f "$out" ]; then
        echo "have $out"
        continue
    fi
    # strata writes OUT.partial and renames it when complete, so an interrupted run leaves no file here.
    "$strata" quantize "$source_model" "$out" --type "$ty"
done
