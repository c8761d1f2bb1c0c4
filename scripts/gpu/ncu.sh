#!/usr/bin/env bash
# One H200: Nsight Compute's speed-of-light, memory, scheduler, warp-state, launch and occupancy
# sections for launches of the kernels NCU_KERNELS (a regex) into $OUT/ncu_$NCU_NAME.log, either
# inside `strata bench-gpu --attention` (NCU_RUN=attention, the default: 240 sequences, contexts
# 512..768) or inside eager steps of the engine serving 256 users on Llama-3-8B (NCU_RUN=step: every
# kernel of a step, so a small kernel's own time shows apart from its launch). NCU_SKIP launches of
# the kernels are passed over first (attention: 3, the sweep's warm-ups; step: past the prompts, into
# decode steps of ~256 sequences), then NCU_COUNT (default 1) are profiled. NCU_RUN=quant: the
# tensor-core GEMM over Q4_K/Q6_K blocks in eager 256-user decode steps of the 7B-shaped Q4_K_M
# (every step on it: STRATA_QUANT_GEMM_MAX_TOKENS=512); NCU_RUN=fp8: the FP8 decode GEMVs of one
# stream on the 7B checkpoint under --quantization fp8; NCU_RUN=wide: the wide tiles (default
# qgemm_wide_q4_k) in eager decode steps of NCU_LEVELS (default 256) users of the Q4_K_M. Clocks
# are left as they are (--clock-control none), so durations are comparable with the benchmarks'.
# NCU_DURATIONS=1 and NCU_SASS=1 (below) collect less or more.
set -u
OUT=${OUT:-/tmp/out}
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 0; }
source "$(dirname "$0")/libs.sh"
RUN=${NCU_RUN:-attention}
NAME=${NCU_NAME:-$RUN}
if [ "$RUN" = step ]; then
    llama3_8b_checkpoint
    ARGS="bench-gpu --model $L8 --enforce-eager --levels 256 --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 256"
    SKIP=${NCU_SKIP:-12000}
elif [ "$RUN" = quant ]; then
    qwen7b_checkpoint
    qwen7b_q4_k_m
    export STRATA_QUANT_GEMM_MAX_TOKENS=512
    ARGS="bench-gpu --model $Q4KM --enforce-eager --levels 256 --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 64 --decode-tokens 32"
    KERNELS=${NCU_KERNELS:-qgemm_q}
    SKIP=${NCU_SKIP:-2000}
elif [ "$RUN" = wide ]; then
    qwen7b_checkpoint
    qwen7b_q4_k_m
    # 24 GiB, for the memory ncu saves and restores around each replayed kernel (as fp8 below).
    ARGS="bench-gpu --model $Q4KM --enforce-eager --gpu-memory-limit 24GiB --levels ${NCU_LEVELS:-256} --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 64 --decode-tokens 32"
    KERNELS=${NCU_KERNELS:-qgemm_wide_q4_k\$}
    SKIP=${NCU_SKIP:-300}
elif [ "$RUN" = fp8 ]; then
    qwen7b_checkpoint
    # A 16 GiB card: ncu saves and restores device memory around each replayed kernel, and failed
    # doing that with the whole H100 taken by the KV cache.
    ARGS="bench-gpu --model $Q7 --quantization fp8 --gpu-memory-limit 16GiB --enforce-eager --levels 1 --kv-cache-dtypes auto --prompt-tokens 512 --output-tokens 64 --decode-tokens 32"
    KERNELS=${NCU_KERNELS:-fp8_gemv}
    SKIP=${NCU_SKIP:-400}
else
    ARGS="bench-gpu --attention --levels 240 --prompt-tokens 512 --output-tokens 256"
    SKIP=${NCU_SKIP:-3}
fi
# NCU_REPLAY=application replays the whole program once per pass instead of saving and restoring
# device memory around each kernel (ncu failed that way on the FP8 GEMVs of a 7B model).
# NCU_STALLS=1 adds each stall reason's warps per issued instruction (the WarpStateStats section
# prints only their total): what a warp waits on, e.g. a barrier, a wgmma group or a load.
# NCU_DURATIONS=1 collects only each launch's duration (one pass, no memory saved and restored),
# so NCU_COUNT can cover every kernel of a step (NCU_KERNELS=. and a count of ~1,000 for a
# 28-layer eager step), and prints a line a launch: name, grid, microseconds.
# NCU_SASS=1 samples where the warps wait instruction by instruction (source counters, into the
# report /tmp/ncu_$NAME.ncu-rep): $OUT/ncu_$NAME.log its speed of light and warp states,
# ncu_${NAME}_sass.csv.gz the SASS page, stalls_$NAME.txt that page summed by sass_stalls.py.
WHAT=(--section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy
    --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis)
[ -n "${NCU_DURATIONS:-}" ] && WHAT=(--metrics gpu__time_duration.sum)
LOG="$OUT/ncu_$NAME.log"
if [ -n "${NCU_SASS:-}" ]; then
    WHAT=(--section SpeedOfLight --section WarpStateStats --section SourceCounters --import-source no
        -o "/tmp/ncu_$NAME" -f)
    LOG="$OUT/ncu_run_$NAME.log"
fi
STALLS=()
[ -n "${NCU_STALLS:-}" ] && STALLS=(--metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio')
timeout ${NCU_TIMEOUT:-400} "$NCU" --clock-control none ${NCU_REPLAY:+--replay-mode $NCU_REPLAY} -k "regex:${KERNELS:-${NCU_KERNELS:-paged_attention_staged_bf16}}" -s "$SKIP" -c "${NCU_COUNT:-1}" \
    "${WHAT[@]}" "${STALLS[@]}" $S $ARGS --out /tmp/ncu_$NAME.json 2>&1 | grep -v "^\[" > "$LOG"
if [ -n "${NCU_SASS:-}" ]; then
    "$NCU" --import "/tmp/ncu_$NAME.ncu-rep" --print-summary none > "$OUT/ncu_$NAME.log" 2>&1
    "$NCU" --import "/tmp/ncu_$NAME.ncu-rep" --page source --csv --print-source sass 2>&1 |
        gzip > "$OUT/ncu_${NAME}_sass.csv.gz"
    python3 "$(dirname "$0")/sass_stalls.py" "$OUT/ncu_${NAME}_sass.csv.gz" --top 30 > "$OUT/stalls_$NAME.txt"
    head -25 "$OUT/stalls_$NAME.txt"
fi
if [ -n "${NCU_DURATIONS:-}" ]; then
    awk '/^  [a-z_].*\(/ { launch = $0; sub(/^ +/, "", launch); sub(/, Context.*/, "", launch) }
        /gpu__time_duration.sum/ { print launch ": " $NF " " $(NF-1) }' \
        "$OUT/ncu_$NAME.log" > "$OUT/ncu_${NAME}_durations.txt"
    head -${NCU_SUMMARY_LINES:-80} "$OUT/ncu_${NAME}_durations.txt"
    exit 0
fi
grep -E "^  [a-z_]+.*\(|Duration|Pipe|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|Grid Size|Block Size|issue_stalled" \
    "$OUT/ncu_$NAME.log" | head -${NCU_SUMMARY_LINES:-80}
