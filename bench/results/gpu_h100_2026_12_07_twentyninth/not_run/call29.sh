#!/usr/bin/env bash
# Twenty-ninth sitting, for the next: v53 (branch v53-wide-phase, 3265580) under the quant kernel
# tests, then where its wide tiles wait: call25's ncu sampling on its build. v53 cut a fifth of the
# wide step's instructions and gained ~1 % (call28); if the tensor cores stay ~68 % busy, the
# register-sourced products of two warpgroups are the bound (bench/NOTES.md v53). Build gpu-bin
# from the branch first. Carries strata.gz, cuda-kernels-test.gz, tokenizers-qwen2.5.tgz,
# llama-src.tar.xz.
set -u
OUT=${OUT:-/tmp/out}
source scripts/gpu/libs.sh
start_results call29
pack_every 15
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
(qwen7b_checkpoint; qwen7b_q4_k_m) > "$OUT/prepare.log" 2>&1 &
PREP=$!
timeout 200 gpu-bin/cuda-kernels-test --skip compile:: --test-threads 1 quant:: > "$OUT/kernels.log" 2>&1
grep -hE "^test |panicked|test result" "$OUT/kernels.log" | cut -c1-300
wait $PREP; tail -1 "$OUT/prepare.log"
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
    echo "-- $1 (t=$SECONDS)"; grep -E "Duration|Compute \(SM\)|Warp Cycles Per Issued" "$OUT/ncu_$1.log" | head -6
    python3 scripts/gpu/sass_stalls.py "$OUT/ncu_$1_sass.csv.gz" --top 30 > "$OUT/stalls_$1.txt"
    head -25 "$OUT/stalls_$1.txt"
}
sample q4_k_256 'qgemm_wide_q4_k$' 256 300
sample q6_k_256 'qgemm_wide_q6_k$' 256 100
echo "end t=$SECONDS"
packer_stop
