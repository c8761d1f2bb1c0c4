#!/usr/bin/env bash
# Twenty-eighth sitting, for the next: where the wide tiles' warps wait, instruction by
# instruction, on main's build (v49 kernels). A wide step takes ~1 us where its products need
# ~0.59 (bench/NOTES.md, "the 256-user gap"), and no ncu run has sampled the current kernels'
# SASS. ncu's source counters for two launches each of qgemm_wide_q4_k and qgemm_wide_q6_k in
# eager 256-user decode steps, and of qgemm_wide64_q4_k in 32-user ones, of the random Qwen2.5-7B
# as Q4_K_M; scripts/gpu/sass_stalls.py prints each launch's stall reasons and hot instructions.
# Carries strata.gz (main), tokenizers-qwen2.5.tgz, llama-src.tar.xz.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call25
pack_every 15
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
(qwen7b_checkpoint; qwen7b_q4_k_m) > "$OUT/prepare.log" 2>&1
tail -1 "$OUT/prepare.log"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
sample() {  # name kernel-regex users skip
    [ $SECONDS -lt 420 ] || { echo "-- $1 skipped (t=$SECONDS)"; return; }
    timeout 150 "$NCU" --clock-control none -k "regex:$2" -s "$4" -c 2 --section SpeedOfLight \
        --section WarpStateStats --section SourceCounters --import-source no -o "/tmp/ncu_$1" -f \
        $S bench-gpu --model $Q4KM --enforce-eager --gpu-memory-limit 24GiB --levels "$3" \
        --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 64 --decode-tokens 32 \
        --out /tmp/ncu.json 2>&1 | grep -v "outside the vocabulary" > "$OUT/ncu_run_$1.log"
    "$NCU" --import "/tmp/ncu_$1.ncu-rep" --print-summary none > "$OUT/ncu_$1.log" 2>&1
    "$NCU" --import "/tmp/ncu_$1.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip > "$OUT/ncu_$1_sass.csv.gz"
    echo "-- $1 (t=$SECONDS)"; grep -E "Grid Size|Duration|Issue Slots Busy" "$OUT/ncu_$1.log" | head -6
    python3 scripts/gpu/sass_stalls.py "$OUT/ncu_$1_sass.csv.gz" --top 30 > "$OUT/stalls_$1.txt"
    head -40 "$OUT/stalls_$1.txt"
}
sample q4_k_256 'qgemm_wide_q4_k$' 256 300
sample q6_k_256 'qgemm_wide_q6_k$' 256 100
sample q4_k_64_32 'qgemm_wide64_q4_k$' 32 300
echo "end t=$SECONDS"
packer_stop
