#!/usr/bin/env bash
# One H200: Nsight Compute's speed-of-light, memory, scheduler, warp-state, launch and occupancy
# sections for one launch of the staged attention kernel inside `strata bench-gpu --attention`
# (240 sequences, contexts 512..768), into $OUT/ncu_attention.log. NCU_SKIP (default 3) launches
# of the kernel are passed over first (the sweep's warm-ups and earlier variants). ncu locks the
# clocks at base, so its times are not a step's; its ratios (occupancy, stalls) are.
set -u
OUT=${OUT:-/tmp/out}
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 0; }
source "$(dirname "$0")/libs.sh"
timeout 200 "$NCU" -k regex:paged_attention_staged_bf16 -s "${NCU_SKIP:-3}" -c 1 --section SpeedOfLight \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section SchedulerStats $S bench-gpu --attention --levels 240 --prompt-tokens 512 --output-tokens 256 \
    --out /tmp/ncu_attention.json 2>&1 | grep -v "^\[" | tail -120 > "$OUT/ncu_attention.log"
tail -100 "$OUT/ncu_attention.log"
